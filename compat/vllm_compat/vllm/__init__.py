"""vLLM-compatible names, forwarded to pagedllm (installed by the optional `pagedllm-vllm-compat` package)."""
from __future__ import annotations

from pagedllm import BeamSearchParams, SamplingParams, __version__  # noqa: F401

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "EngineArgs", "LoRARequest",
           "PoolingParams", "EmbeddingRequestOutput", "TextPrompt", "TokensPrompt", "__version__"]


def __getattr__(name: str):  # lazy, like pagedllm: `import vllm` must not import torch
    if name in ("LLM", "RequestOutput", "CompletionOutput", "PoolingParams", "EmbeddingRequestOutput", "TextPrompt",
                "TokensPrompt"):
        import pagedllm

        return getattr(pagedllm, name)
    if name == "EngineArgs":
        from pagedllm.config import EngineArgs

        return EngineArgs
    if name == "LoRARequest":
        from vllm.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'vllm' has no attribute {name!r}")
