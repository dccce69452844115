"""pagedllm: a fast LLM inference and serving engine."""
__version__ = "0.1.0"

# OpenMP threads (torch's and the C++ CPU kernels') that spin between parallel regions stall every region
# whenever the machine has other work (docs/benchmarks.md). pagedllm's own threads sleep instead, unless the
# user chose a policy: set for libgomp's load only, never left in os.environ (other programs, started from
# the same script, keep their own defaults). openmp.py says how.
from pagedllm import openmp as _openmp

_openmp.load_with_own_policy()

from pagedllm.sampling_params import BeamSearchParams, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "LoRARequest",
           "PoolingParams", "EmbeddingRequestOutput", "ClassificationRequestOutput", "ScoringRequestOutput",
           "TextPrompt", "TokensPrompt", "__version__"]


def __getattr__(name):  # lazy: importing pagedllm must not import torch
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM
        return LLM
    if name == "LoRARequest":
        from pagedllm.lora.request import LoRARequest
        return LoRARequest
    if name in ("PoolingParams", "EmbeddingRequestOutput", "ClassificationRequestOutput", "ScoringRequestOutput"):
        from pagedllm import pooling
        return getattr(pooling, name)
    if name in ("TextPrompt", "TokensPrompt"):
        from pagedllm import inputs
        return getattr(inputs, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedllm import outputs
        return getattr(outputs, name)
    raise AttributeError(name)
