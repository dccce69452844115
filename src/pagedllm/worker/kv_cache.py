"""KV pool sizing and allocation.

The pool is one [2, num_blocks, block_size, num_kv_heads, head_size] tensor per layer. Its size comes from
a memory budget: on CUDA `gpu_memory_utilization` x total memory minus what the weights and a profiled peak
forward already take; on CPU `kv_cache_memory_bytes` (default: a share of available RAM, at most 4 GiB).
`num_gpu_blocks_override` (vLLM's name) forces the block count.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

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
