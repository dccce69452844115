"""vLLM-compatible names, forwarded to pagedllm (installed by the optional `pagedllm-vllm-compat` package)."""
from __future__ import annotations

from pagedllm import BeamSearchParams, SamplingParams, __version__  # noqa: F401

# vLLM's top-level pooling outputs (`from vllm import PoolingRequestOutput`, type hints and isinstance checks of
# LLM.encode / classify / score results): pagedllm.pooling's classes.
_POOLING_OUTPUTS = ("EmbeddingOutput", "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput",
                    "ScoringOutput", "ScoringRequestOutput", "PoolingOutput", "PoolingRequestOutput")

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "EngineArgs", "LoRARequest",
           "PoolingParams", "TextPrompt", "TokensPrompt", "__version__", *_POOLING_OUTPUTS]


def __getattr__(name: str):  # lazy, like pagedllm: `import vllm` must not import torch
    if name in ("LLM", "RequestOutput", "CompletionOutput", "PoolingParams", "TextPrompt", "TokensPrompt"):
        import pagedllm

        return getattr(pagedllm, name)
    if name in _POOLING_OUTPUTS:
        import pagedllm.pooling

        return getattr(pagedllm.pooling, name)
    if name == "EngineArgs":
        from pagedllm.config import EngineArgs

        return EngineArgs
    if name == "LoRARequest":
        from vllm.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'vllm' has no attribute {name!r}")
