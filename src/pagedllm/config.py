"""Engine configuration: user-facing EngineArgs (vLLM's names) -> one validated, frozen EngineConfig tree.

EngineArgs is what `LLM(...)` kwargs, CLI flags and `--config FILE.yaml` fill in. `create_engine_config()`
resolves the model (default model, GGUF conversion), reads its HF config, picks device and dtype, and
validates everything once, raising ValueError with a sentence that says what to change.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

_DTYPES = {"auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"}
_NOT_SUPPORTED_YET: dict[str, Any] = {
    # arg name -> the default value that means "off"; anything else fails at start (never silently ignored).
    "pipeline_parallel_size": 1,
    "cpu_offload_gb": 0,
    "enable_lora": False,
    "quantization": None,
    "speculative_config": None,
}


@dataclass
class EngineArgs:
    model: Optional[str] = None  # HF directory, .gguf file, or None for the default SmolLM2 model
    tokenizer: Optional[str] = None
    served_model_name: Optional[str] = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    dtype: str = "auto"
    seed: int = 0
    load_format: str = "auto"  # "auto" | "safetensors" | "gguf" | "dummy"
    max_model_len: Optional[int] = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: Optional[int] = None  # CPU (and override on GPU): bytes for the KV pool
    num_gpu_blocks_override: Optional[int] = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    device: str = "auto"  # "auto" | "cuda" | "cpu"
    enforce_eager: bool = False
    attention_backend: Optional[str] = None
    async_scheduling: Optional[bool] = None  # None: on for CUDA, off for CPU
    quantization: Optional[str] = None
    cpu_offload_gb: float = 0
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    speculative_config: Optional[dict] = None
    disable_log_stats: bool = True
    max_logprobs: int = 20
    # Structured outputs: {"backend": "auto" | "xgrammar" | "guidance", "disable_any_whitespace": bool, ...}
    structured_outputs_config: Optional[dict] = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise TypeError(f"Unknown engine argument(s): {', '.join(sorted(unknown))}.")
        return cls(**kwargs)

    def validate(self) -> None:
        for name, off in _NOT_SUPPORTED_YET.items():
            if getattr(self, name) != off:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}={getattr(self, name)!r} is not supported yet by pagedllm.")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}.")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors, gguf or dummy, got {self.load_format!r}.")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}.")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {self.device!r}.")
