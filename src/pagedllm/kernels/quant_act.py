"""Dynamic per-token FP8 (E4M3) quantization of activations in one kernel (Triton).

The torch form (abs, amax, upcast, divide, clamp, cast) launches six kernels and moves several fp32 copies of
the activations per linear layer, which in a long prefill costs a good part of what the FP8 matmul saves. Here
one program per row reads the row twice (amax, then scale and cast) and writes only the E4M3 values and the
row's scale. Numerics equal the torch reference `quantization.kernels.quantize_fp8_per_token`: the scale is
amax / 448 in fp32 (at least 1e-12), each value is x / scale in fp32, clamped, rounded to nearest even.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _fp8_per_token_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, K,
                          FP8_MAX: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    cols = tl.arange(0, BLOCK)
    if SINGLE:  # the whole row in registers: one read
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
        scale = tl.maximum(amax / FP8_MAX, 1e-12)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            mask = start + cols < K
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
        scale = tl.maximum(tl.max(acc, 0) / FP8_MAX, 1e-12)
        for start in range(0, K, BLOCK):
            mask = start + cols < K
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
            tl.store(q_row + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, last dim contiguous) -> (E4M3 [M, K], fp32 scale [M, 1])."""
    assert x.dim() == 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    single = k <= 8192
    block = triton.next_power_of_2(k) if single else 2048
    _fp8_per_token_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), k, FP8_MAX=FP8_MAX, BLOCK=block,
                                   SINGLE=single, num_warps=8 if block >= 4096 else 4)
    return q, scale
