"""Skinny GEMM for linear layers of 2..16 rows (speculative verify steps: k + 1 rows per request), Triton.

At a few rows a linear layer is still a pass over its weight. The GEMV (kernels/gemv.py) multiplies each row on
CUDA cores, a full pass of multiply-adds per row, which loses to cuBLAS past a few rows on large weights. This
kernel pads the rows to one 16-row tensor-core tile instead: each program owns BLOCK_N weight rows, streams
them along K in BLOCK_K tiles (software-pipelined) and accumulates `x @ W^T` for every row with `tl.dot`, so
the extra rows cost almost nothing beside the weight stream. Like the GEMV, the first weight tile is loaded
before `griddepcontrol.wait` (weights never depend on the previous kernel), and `gated=True` fuses
`silu(gate) * up` of a merged [gate; up] weight.

Numerics: fp32 accumulation, rounded once to the output dtype (gated: gate and up rounded to the activation
dtype, then the activation, then the product, as the unfused layers do); sums in another order than cuBLAS's.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel

SKINNY_MAX_ROWS = 16  # one tensor-core tile of rows


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, stride_xm, stride_wn, stride_om, up_offset,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features (weight rows)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    # First weight tile before the wait: it overlaps the previous kernel's tail under PDL.
    k_ok = ks < K
    w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
    if GATED:
        w_up = tl.load(w_ptrs + up_offset, mask=col_ok[:, None] & k_ok[None, :], other=0.0,
                       eviction_policy="evict_first")
    wait_prior_kernel(USE_PDL)
    x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w), out_dtype=tl.float32)  # [BLOCK_M, BLOCK_N]
    if GATED:
        acc_up = tl.dot(x, tl.trans(w_up), out_dtype=tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        w = tl.load(w_ptrs + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            w_up = tl.load(w_ptrs + up_offset + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0,
                           eviction_policy="evict_first")
            acc_up = tl.dot(x, tl.trans(w_up), acc_up)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        acc = act * acc_up.to(out_ty).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def skinny_block_n(n: int) -> int:
    # Narrow tiles where a layer has few output features, so every SM gets programs.
    return 32 if n >= 32 * 264 else 16


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, gated: bool = False,
                block_n: Optional[int] = None, block_k: Optional[int] = None, num_warps: int = 4,
                num_stages: int = 4) -> torch.Tensor:
    """x: [M <= 16, K]; weight: [N, K] (gated: [2 * N', K], gate rows then up rows). Returns [M, N] (gated:
    [M, N'])."""
    m, k = x.shape
    n_total, k_w = weight.shape
    assert k == k_w and m <= SKINNY_MAX_ROWS, (x.shape, weight.shape)
    n = n_total // 2 if gated else n_total
    assert not gated or n_total % 2 == 0, weight.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if bias is not None:
        assert bias.shape == (n_total,) and bias.stride(0) == 1, bias.shape
    block_n = block_n or skinny_block_n(n)
    block_k = block_k or (128 if gated or x.dtype == torch.float32 else 256)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out,
        m, x.stride(0), weight.stride(0), out.stride(0), n * weight.stride(0),
        N=n, K=k, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        GATED=gated, HAS_BIAS=bias is not None, num_warps=num_warps, num_stages=num_stages,
        **pdl_launch_args(x.device))
    return out
