"""The matmuls of the quantized linear methods: torch references (the CPU path: dequantize on the fly) and,
on CUDA, the Triton kernels where they apply. Each function computes `x @ dequant(W)^T + bias`."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W8A16: qweight int8 [out, in], per-output-channel scale [out]."""
    out = F.linear(x, qweight.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias


def packed_int_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      bits: int, group_size: int, g_idx: Optional[torch.Tensor] = None,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """4/8-bit weight-only: the internal layout of `quantization/packed.py`."""
    from pagedllm.quantization.packed import dequantize_packed

    w = dequantize_packed(qweight, scales, zeros, bits, group_size, g_idx, dtype=x.dtype)
    return F.linear(x, w, bias)
