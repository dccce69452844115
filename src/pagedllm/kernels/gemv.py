"""Weight-streaming GEMV for decode steps of a few rows (Triton), with an optional fused SiLU-and-mul.

At one to a few rows, a linear layer is a pass over its weight: the time is bytes / bandwidth, plus the gap
before the kernel can start. This kernel gives each program a block of whole weight rows ([BLOCK_N, K], held in
registers) and multiplies it by every input row. Two things make it faster than cuBLAS there:
- its weight loads are issued *before* `griddepcontrol.wait` (the weights do not depend on the previous kernel),
  so under programmatic dependent launch the first wave of programs streams weights while the kernel before
  it (an RMSNorm, the attention reduce) is still running;
- `gated=True` computes `silu(x @ W_gate^T) * (x @ W_up^T)` from a merged [gate; up] weight, which saves the
  separate activation kernel and a round trip of the intermediate activations;
- `lora=LoRADelta(...)` adds each row's LoRA delta `h[row] @ B[slot(row)]` to the product before the rounding
  (and before the activation when gated): the expand of a multi-LoRA step costs no launch of its own (lora/).

Loading before the wait assumes the weights are constant while a forward runs (nothing in the engine writes them
after loading); a kernel that wrote a weight right before this one would race with those loads.

Numerics: products summed in fp32, rounded once to the output dtype (the gated path rounds gate and up to the
activation dtype before the activation, then the activation, then the product, as `silu_and_mul` after a
linear layer does). Sums are in a different order than cuBLAS's, so results differ from it in the last bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm import envs
from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel

# Weight elements held by one program (registers): 16k bf16 = 32 KB. Measured on H200 (benchmarks/gemv.py).
_TILE_ELEMENTS = 16384
# Longest reduction dimension handled (the whole row must fit one program's registers).
GEMV_MAX_K = 16384


@triton.jit
def _lora_h(h_ptr, stride_hs, row_off, offs, mask, SPLIT: tl.constexpr):
    """Sum of a LoRA shrink's SPLIT partial sums (fp32) at `row_off + offs`."""
    h = tl.load(h_ptr + row_off + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT):
        h += tl.load(h_ptr + s * stride_hs + row_off + offs, mask=mask, other=0.0)
    return h


@triton.jit
def _lora_b(b_ptr, slot_ptr, m, M, rows, row_ok, offs_r, stride_bs, stride_br, up_cols,
            R: tl.constexpr, GATED: tl.constexpr):
    """Row m's slot (-1 past M or without an adapter) and its B tile(s) [BLOCK_N, R] for the output rows."""
    slot = tl.load(slot_ptr + m, mask=m < M, other=-1)
    r_ok = (offs_r < R) & (slot >= 0)
    b_mask = row_ok[:, None] & r_ok[None, :]
    b_ptrs = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + offs_r[None, :] * stride_br + rows[:, None]
    b = tl.load(b_ptrs, mask=b_mask, other=0.0)
    b_up = b
    if GATED:
        b_up = tl.load(b_ptrs + up_cols, mask=b_mask, other=0.0)
    return r_ok, b_mask, b, b_up


@triton.jit
def _lora_hrow(h_ptr, stride_hs, stride_hm, m, r_ok, b_mask, h_cols, offs_r,
               R: tl.constexpr, SPLIT: tl.constexpr, GATED: tl.constexpr, N_SLICES: tl.constexpr):
    """Row m's shrink, summed over splits: [R] (gate's when GATED, or the one slice), or [BLOCK_N, R] per output
    row's slice; and the up slice's [R] when GATED."""
    if N_SLICES > 1 and not GATED:
        h = _lora_h(h_ptr, stride_hs, m * stride_hm, h_cols, b_mask, SPLIT)
    else:
        h = _lora_h(h_ptr, stride_hs, m * stride_hm, offs_r, r_ok, SPLIT)
    h_up = h
    if GATED:
        h_up = _lora_h(h_ptr, stride_hs, m * stride_hm + R, offs_r, r_ok, SPLIT)
    return h, h_up


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, h_ptr, b_ptr, slot_ptr,
    M, stride_xm, stride_wn, stride_om, up_offset,
    stride_hs, stride_hm, stride_bs, stride_br, lora_s1, lora_s2,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_N: tl.constexpr, K_PAD: tl.constexpr,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    LORA: tl.constexpr, SPLIT: tl.constexpr, R: tl.constexpr, N_SLICES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, K_PAD)
    row_ok = rows < N
    col_ok = cols < K
    w_mask = row_ok[:, None] & col_ok[None, :]
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    # Weights first: they do not depend on the previous kernel, so these loads overlap its tail under PDL.
    w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
    if GATED:
        w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0, eviction_policy="evict_first")
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if GATED:
            bias_up = tl.load(bias_ptr + N + rows, mask=row_ok, other=0.0).to(tl.float32)
    if LORA:
        offs_r = tl.arange(0, R)
        # which slice (q / k / v ...) each output row belongs to: its columns of h
        h_cols = ((rows >= lora_s1).to(tl.int32) + (rows >= lora_s2).to(tl.int32))[:, None] * R + offs_r[None, :]
        # The slot table and B are written before the forward starts, never by the previous kernel: the first
        # row's B tile is loaded before the wait too, so the epilogue waits for nothing but h.
        r_ok, b_mask, b_tile, b_up = _lora_b(b_ptr, slot_ptr, 0, M, rows, row_ok, offs_r, stride_bs, stride_br, N,
                                             R, GATED)
    wait_prior_kernel(USE_PDL)
    out_ty = out_ptr.dtype.element_ty
    x_next = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
    if LORA:
        h_next, h_up_next = _lora_hrow(h_ptr, stride_hs, stride_hm, 0, r_ok, b_mask, h_cols, offs_r, R, SPLIT, GATED,
                                       N_SLICES)
    for m in range(M):  # a runtime count: one compiled variant for one row and one for several
        x = x_next.to(tl.float32)
        # The next row's load is in flight while this row is reduced, hiding its L2 latency.
        x_next = tl.load(x_ptr + (m + 1) * stride_xm + cols, mask=col_ok & (m + 1 < M), other=0.0)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_BIAS:
            acc += bias
        if GATED:
            acc_up = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
            if HAS_BIAS:
                acc_up += bias_up
        if LORA:
            h, h_up, b_cur, b_up_cur = h_next, h_up_next, b_tile, b_up
            r_ok, b_mask, b_tile, b_up = _lora_b(b_ptr, slot_ptr, m + 1, M, rows, row_ok, offs_r, stride_bs,
                                                 stride_br, N, R, GATED)
            h_next, h_up_next = _lora_hrow(h_ptr, stride_hs, stride_hm, m + 1, r_ok, b_mask, h_cols, offs_r, R,
                                           SPLIT, GATED, N_SLICES)
            if N_SLICES > 1 and not GATED:
                acc += tl.sum(b_cur.to(tl.float32) * h, axis=1)
            else:
                acc += tl.sum(b_cur.to(tl.float32) * h[None, :], axis=1)
            if GATED:
                acc_up += tl.sum(b_up_cur.to(tl.float32) * h_up[None, :], axis=1)
        if GATED:
            gate = acc.to(out_ty).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
            acc = act * acc_up.to(out_ty).to(tl.float32)
        tl.store(out_ptr + m * stride_om + rows, acc.to(out_ty), mask=row_ok)


@dataclass
class LoRADelta:
    """The LoRA delta `gemv` adds to each row: h[:, row] (summed over its first dim) @ B[slot(row)].

    h: [SPLIT, >= M, n_slices * R] fp32, a shrink's partial sums (kernels/lora.py, kernels/norm.py);
    b: [S, R, N_total] contiguous, slice j's columns at the output rows it feeds (gated: gate then up);
    token_slots: [>= M] int32, each row's slot (-1: no adapter, no delta);
    slice_starts: the first output rows of slices 1, 2, ... (not gated; up to 3 slices)."""

    h: torch.Tensor
    b: torch.Tensor
    token_slots: torch.Tensor
    slice_starts: tuple[int, ...] = ()


def gemv_max_rows() -> int:
    """Most rows (tokens) for which the linear layers use this kernel instead of cuBLAS; 0 turns it off."""
    return envs.PAGEDLLM_GEMV_MAX_ROWS


# Above this many weight elements the kernel is used for one row only. Each extra row costs the kernel a full pass
# of multiply-adds and a cross-warp reduction over its register tile; on a large weight that outweighs what it gains
# over cuBLAS, and past 4 rows cuBLAS wins at every size, hence PAGEDLLM_GEMV_MAX_ROWS=4 (benchmarks/gemv.py
# --chain-only; numbers in docs/benchmarks.md, GPU section).
MULTI_ROW_MAX_WEIGHT = 8 * 1024 * 1024


def _rows_kernel(rows: int, weight: torch.Tensor) -> Optional[str]:
    """Which few-row kernel takes `rows` rows of this weight: "gemv" (one row; up to PAGEDLLM_GEMV_MAX_ROWS rows
    for weights of at most MULTI_ROW_MAX_WEIGHT elements), or None (cuBLAS). (A tensor-core skinny GEMM for 2..16
    rows lost to cuBLAS on the H200 and was deleted: docs/benchmarks.md, the seven GPU switches.)"""
    if rows == 0:
        return None
    if rows <= gemv_max_rows() and (rows == 1 or weight.numel() <= MULTI_ROW_MAX_WEIGHT):
        return "gemv"
    return None


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` handles `x @ weight.T`: CUDA, fp16/bf16, contiguous rows, a K that fits one program, and few
    rows (`_rows_kernel`)."""
    if not (x.is_cuda and x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype
            and x.dtype in (torch.float16, torch.bfloat16) and weight.stride(1) == 1 and x.stride(1) == 1
            and weight.shape[1] <= GEMV_MAX_K and not x.requires_grad):
        return False
    return _rows_kernel(x.shape[0], weight) is not None


def gemv_block_n(n: int, k: int) -> int:
    k_pad = triton.next_power_of_2(k)
    return max(1, min(triton.next_power_of_2(n), _TILE_ELEMENTS // k_pad))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, gated: bool = False,
         block_n: Optional[int] = None, num_warps: int = 8, lora: Optional[LoRADelta] = None,
         maxnreg: Optional[int] = None) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] (gated: [2 * N', K], gate rows then up rows). Returns [M, N] (gated: [M, N'])."""
    m, k = x.shape
    n_total, k_w = weight.shape
    assert k == k_w, (x.shape, weight.shape)
    n = n_total // 2 if gated else n_total
    assert not gated or n_total % 2 == 0, weight.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if block_n is None:
        block_n = gemv_block_n(n, k) // (2 if gated else 1) or 1
    if bias is not None:
        assert bias.shape == (n_total,) and bias.stride(0) == 1, bias.shape
    lora_args: tuple = (weight, weight, weight, 0, 0, 0, 0, n, n)
    split, rank, n_slices = 1, 16, 1
    if lora is not None:
        h, b = lora.h, lora.b
        split, rank = h.shape[0], b.shape[1]
        n_slices = 2 if gated else len(lora.slice_starts) + 1
        assert b.is_contiguous() and b.shape[2] == n_total and h.stride(-1) == 1 and h.shape[1] >= m, (h.shape, b.shape)
        assert h.shape[2] == n_slices * rank and n_slices <= 3 and lora.token_slots.dtype == torch.int32, h.shape
        starts = list(lora.slice_starts) + [n] * 2
        lora_args = (h, b, lora.token_slots, h.stride(0), h.stride(1), b.stride(0), b.stride(1), starts[0], starts[1])
    h_ptr, b_ptr, slot_ptr, *lora_strides = lora_args
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, h_ptr, b_ptr, slot_ptr,
        m, x.stride(0), weight.stride(0), out.stride(0), n * weight.stride(0), *lora_strides,
        N=n, K=k, BLOCK_N=block_n, K_PAD=triton.next_power_of_2(k),
        GATED=gated, HAS_BIAS=bias is not None, LORA=lora is not None, SPLIT=split, R=rank, N_SLICES=n_slices,
        num_warps=num_warps, **({} if maxnreg is None else {"maxnreg": maxnreg}), **pdl_launch_args(x.device))
    return out


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
             gated: bool = False, lora: Optional[LoRADelta] = None) -> torch.Tensor:
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if lora is not None:
        m, (num_slots, r, n_total) = x.shape[0], lora.b.shape
        starts = torch.tensor([n] if gated else list(lora.slice_starts), device=x.device)
        slice_of = torch.bucketize(torch.arange(n_total, device=x.device), starts, right=True)  # [N_total]
        h = lora.h.float().sum(0)[:m]  # [M, n_slices * R]
        h_cols = h[:, slice_of[:, None] * r + torch.arange(r, device=x.device)[None, :]]  # [M, N_total, R]
        slots = lora.token_slots[:m].long()
        b_rows = lora.b.float()[slots.clamp(min=0)].transpose(1, 2)  # [M, N_total, R]
        y = y + torch.where((slots >= 0)[:, None], (h_cols * b_rows).sum(-1), 0.0)
    if not gated:
        return y.to(x.dtype)
    gate, up = y[:, :n].to(x.dtype), y[:, n:].to(x.dtype)
    return (torch.nn.functional.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
