"""Random 4/8-bit weights in the internal packed layout (quantization/packed.py), shared by the quantized-kernel
GPU tests. Not a test module: pytest collects only test_*.py."""
from __future__ import annotations

from typing import Optional

import torch


def random_packed_weights(k: int, n: int, bits: int, group_size: int, act_order: bool, dtype: torch.dtype,
                          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(qweight int32 [K / (32 / bits), N], scales [groups, N], zeros [groups, N], g_idx int32 [K] or None), on
    the CPU; group_size -1 is one group over K."""
    gen = torch.Generator().manual_seed(seed)
    pack = 32 // bits
    group_size = k if group_size == -1 else group_size
    qweight = torch.randint(-2**31, 2**31 - 1, (k // pack, n), generator=gen, dtype=torch.int64).to(torch.int32)
    groups = k // group_size
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen).to(dtype)
    g_idx = (torch.argsort(torch.randperm(k, generator=gen)) // group_size).to(torch.int32) if act_order else None
    return qweight, scales, zeros, g_idx
