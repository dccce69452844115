"""pagedllm: a fast LLM inference and serving engine."""
__version__ = "0.1.0"

import os as _os

# OpenMP threads (torch's and the C++ CPU kernels') that spin between parallel regions stall every region
# whenever the machine has other work: a spinning thread burns the slice its preempted sibling needs (a CPU
# decode step runs several times slower under load; docs/benchmarks.md). Sleeping waits are the default here unless
# the user chose a policy; libgomp reads this when torch is first imported (importing pagedllm first).
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

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
