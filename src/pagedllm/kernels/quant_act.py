"""Dynamic per-token FP8 (E4M3) or INT8 quantization of activations in one kernel (Triton).

The torch form (abs, amax, upcast, divide, clamp, cast) launches six kernels and moves several fp32 copies of
the activations per linear layer, which in a long prefill costs a good part of what the FP8 matmul saves. Here
one program per row reads the row twice (amax, then scale and cast) and writes only the quantized values and the
row's scale. Numerics equal the torch reference `quantization.kernels.quantize_fp8_per_token`: the scale is
amax times the fp32 reciprocal of 448 (at least 1e-12), each value is x / scale in fp32 (IEEE division), clamped,
rounded to nearest even. INT8 (`int8_per_token`) equals `quantization.kernels.quantize_int8_per_token`: scale amax
times the fp32 reciprocal of 127, x / scale rounded half to even (torch.round), clamped to [-128, 127]; or one
static scale.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel

FP8_MAX = 448.0


def _inverse(qmax: float) -> float:
    """1 / qmax rounded to fp32 (exact as a Python float). The scale is amax times it, not amax / qmax: torch's
    CUDA division by a Python number multiplies by the reciprocal, its CPU division does not, so the reference
    spells the product out and both devices and this kernel agree bit for bit (the same values as
    `quantization.kernels.FP8_INV_MAX` / `INT8_INV_MAX`, which this leaf cannot import)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(qmax, dtype=torch.float32))


_INV_QMAX = {127.0: _inverse(127.0), FP8_MAX: _inverse(FP8_MAX)}  # once, not per launch


@triton.jit
def _round_half_even(v):
    r = tl.floor(v + 0.5)  # exact: |v| <= 128 here
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - v) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _row_scale(amax, INV_QMAX: tl.constexpr):
    """A row's dynamic scale from its per-lane |x| maxima (reduced here): amax * (1 / qmax), at least 1e-12."""
    return tl.maximum(tl.max(amax, 0) * INV_QMAX, 1e-12)


@triton.jit
def _quantize(x, scale, QMAX: tl.constexpr, INT8: tl.constexpr):
    """x / scale (IEEE division, as torch's) clamped to the format's range; for int8 also rounded half to even
    (clamped first: the bounds are integers, so clamp and round commute). The cast is the caller's."""
    if INT8:
        return _round_half_even(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -128.0), 127.0))
    return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)


@triton.jit
def _per_token_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, stride_x, stride_q, K, QMAX: tl.constexpr,
                      INV_QMAX: tl.constexpr, INT8: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr,
                      SINGLE: tl.constexpr, USE_PDL: tl.constexpr):
    # Launched with PDL: its launch overlaps the kernel before it, and it lets the GEMM after it start and load
    # its weights while it runs (kernels/pdl.py)
    wait_prior_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    cols = tl.arange(0, BLOCK)
    if SINGLE:  # the whole row in registers: one read
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            scale = _row_scale(tl.abs(x), INV_QMAX)
        tl.store(q_row + cols, _quantize(x, scale, QMAX, INT8).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, K, BLOCK):
                mask = start + cols < K
                x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                acc = tl.maximum(acc, tl.abs(x))
            scale = _row_scale(acc, INV_QMAX)
        for start in range(0, K, BLOCK):
            mask = start + cols < K
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + start + cols, _quantize(x, scale, QMAX, INT8).to(q_ptr.dtype.element_ty),
                     mask=mask)
    tl.store(scale_ptr + row, scale)


def _per_token(x: torch.Tensor, dtype: torch.dtype, static_scale: Optional[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    single = k <= 8192
    block = triton.next_power_of_2(k) if single else 2048
    int8 = dtype == torch.int8
    qmax = 127.0 if int8 else FP8_MAX
    static = static_scale is not None
    _per_token_kernel[(rows,)](x, q, scale, static_scale.float().reshape(1) if static else scale, x.stride(0),
                               q.stride(0), k, QMAX=qmax, INV_QMAX=_INV_QMAX[qmax], INT8=int8, STATIC=static,
                               BLOCK=block, SINGLE=single, num_warps=8 if block >= 4096 else 4,
                               **pdl_launch_args(x.device))
    return q, scale


def int8_per_token(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, last dim contiguous) -> (int8 [M, K], fp32 scale [M, 1]); static_scale: one fp32
    scale for every row instead of each row's amax / 127."""
    return _per_token(x, torch.int8, static_scale)


def fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, last dim contiguous) -> (E4M3 [M, K], fp32 scale [M, 1])."""
    return _per_token(x, torch.float8_e4m3fn, None)
