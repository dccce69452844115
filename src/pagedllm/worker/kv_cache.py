"""KV pool sizing and allocation.

The pool is one [2, num_blocks, block_size, num_kv_heads, head_size] tensor per layer, or with several KV-cache
groups (layers with different sliding windows) one per slot, shared by a layer of each group
(core/kv_cache_groups.py). Its size comes from
a memory budget: on CUDA `gpu_memory_utilization` x total memory minus what the weights and a profiled peak
forward already take; on CPU `kv_cache_memory_bytes` (default: a share of available RAM, at most 4 GiB).
`num_gpu_blocks_override` (vLLM's name) forces the block count.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedllm.core.kv_cache_groups import KVCacheGroups, kv_cache_groups

logger = logging.getLogger(__name__)

_CPU_DEFAULT_MAX_BYTES = 4 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # on this rank
    head_size: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * elem

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size


def attn_layer_index(layer: Any, default: int) -> int:
    """A model layer's number from its Attention's prefix ("model.layers.3.self_attn.attn"), else `default`."""
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", getattr(layer, "prefix", "") or "")
    return int(match.group(1)) if match else default


def model_kv_cache_groups(model: Any, max_model_len: int) -> KVCacheGroups:
    """The KV-cache groups of a model: from every layer's window (`model.kv_layer_windows()`, which pipeline stages
    need: they hold only some layers), else from the layers it holds; a layer whose Attention disagrees with the
    model's list is a bug in the model."""
    layers = model.attn_layers
    listing = getattr(model, "kv_layer_windows", None)
    windows = list(listing()) if listing is not None else [layer.sliding_window for layer in layers]
    for i, layer in enumerate(layers):
        index = attn_layer_index(layer, i)
        if index >= len(windows) or windows[index] != layer.sliding_window:
            raise ValueError(f"{layer.prefix}: its sliding window ({layer.sliding_window}) differs from the "
                             f"model's ({windows[index] if index < len(windows) else 'not listed'}); a model whose "
                             f"windows do not follow models.llama.layer_sliding_window (or that runs as pipeline "
                             f"stages) must list every layer's in kv_layer_windows().")
    return kv_cache_groups(windows, max_model_len)


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cpu_kv_budget(kv_cache_memory_bytes: Optional[int]) -> int:
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes
    return int(min(_CPU_DEFAULT_MAX_BYTES, 0.3 * available_cpu_memory()))


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device,
                       zeroed: bool = True) -> list[torch.Tensor]:
    # Zeroed by default: a backend whose masked-out lanes multiply what they read must never see NaN/Inf
    # garbage. A backend that never uses unwritten slots (the CPU kernels) takes the pool unzeroed, so its
    # pages are only committed as they fill (zeroing a 4 GiB pool up front takes seconds on a small CPU).
    make = torch.zeros if zeroed else torch.empty
    return [
        make(2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size, dtype=spec.dtype, device=device)
        for _ in range(spec.num_layers)
    ]


# --kv-cache-dtype: "auto" = the model dtype; fp8 = E4M3 (half of bf16's bytes per token: twice the tokens).
FP8_KV_NAMES = ("fp8", "fp8_e4m3")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if name == "auto":
        return model_dtype
    if name not in FP8_KV_NAMES:
        raise ValueError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, got {name!r}.")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major * 10 + minor < 89:
            raise ValueError(f"--kv-cache-dtype fp8 needs a GPU of compute capability >= 8.9 (FP8 conversions), "
                             f"this one is {major}.{minor}; use --kv-cache-dtype auto.")
    return torch.float8_e4m3fn


def kv_cache_backend(kv_dtype: torch.dtype, name: Optional[str], device: torch.device) -> Optional[str]:
    """The attention backend to ask for: on a CPU an FP8 pool goes to the torch backend (the C++ kernels read
    only the model dtype)."""
    if name is None and device.type == "cpu" and kv_dtype == torch.float8_e4m3fn:
        return "torch"
    return name


def check_kv_cache_backend(kv_dtype: torch.dtype, backend) -> None:
    if kv_dtype == torch.float8_e4m3fn and not backend.supports_fp8_kv:
        raise ValueError(f"The {backend.name} attention backend cannot use an FP8 KV cache; pass "
                         f"--attention-backend torch (CPU) or triton (GPU), or --kv-cache-dtype auto.")



def copy_kv_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]], device: torch.device) -> None:
    """Copy whole K/V blocks src -> dst in every layer's cache [2, num_blocks, ...] (BatchPlan.kv_block_copies:
    a partial block continued by a new request). Whole blocks, so any backend's private in-block layout is kept.
    All sources are read before any destination is written (a source may also be a destination)."""
    if not pairs or not kv_caches:
        return
    idx = torch.tensor(pairs, dtype=torch.long).t().contiguous().to(device)
    src, dst = idx[0], idx[1]
    for cache in kv_caches:
        if cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no FP8 kernels on the CPU: move the bytes
            cache = cache.view(torch.uint8)
        cache.index_copy_(1, dst, cache.index_select(1, src))
