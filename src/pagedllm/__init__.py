"""pagedllm: a fast LLM inference and serving engine."""
__version__ = "0.1.0"

from pagedllm.sampling_params import BeamSearchParams, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "LoRARequest",
           "__version__"]


def __getattr__(name):  # lazy: importing pagedllm must not import torch
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM
        return LLM
    if name == "LoRARequest":
        from pagedllm.lora.request import LoRARequest
        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedllm import outputs
        return getattr(outputs, name)
    raise AttributeError(name)
