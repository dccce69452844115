"""Weight-streaming GEMV for decode steps of a few rows (Triton), with an optional fused SiLU-and-mul.

At one to a few rows, a linear layer is a pass over its weight: the time is bytes / bandwidth, plus the gap
before the kernel can start. This kernel gives each program a block of whole weight rows ([BLOCK_N, K], held in
registers) and multiplies it by every input row. Two things make it faster than cuBLAS there:
- its weight loads are issued *before* `griddepcontrol.wait` (the weights do not depend on the previous kernel),
  so under programmatic dependent launch the first wave of programs streams weights while the kernel before
  it (an RMSNorm, the attention reduce) is still running;
- `gated=True` computes `silu(x @ W_gate^T) * (x @ W_up^T)` from a merged [gate; up] weight, which saves the
  separate activation kernel and a round trip of the intermediate activations;
- `lora=` adds each row's LoRA delta (its slot's B times the shrink the kernel before computed) before the rounding
  and the activation: a LoRA step's expand costs no launch of its own.

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
from pagedllm.kernels.norm import _normalize
from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel
from pagedllm.kernels.triton_launch import direct

# Weight elements held by one program (registers): 16k bf16 = 32 KB. Measured on H200 (benchmarks/gemv.py).
_TILE_ELEMENTS = 16384
# Longest reduction dimension handled (the whole row must fit one program's registers).
GEMV_MAX_K = 16384


@dataclass
class GemvLoRA:
    """A LoRA delta for `gemv` to add: h [SPLIT, >= M, n_slices * R] fp32 (the shrink, summed over SPLIT; rows
    without an adapter may hold anything), b [S, R, N_total] (B * scaling per slot, N_total the weight's rows),
    token_slots [>= M] int32 (-1: no adapter), slice_starts: the output columns where the 2nd / 3rd slice start
    (gated: the gate is slice 0, the up projection slice 1)."""

    h: torch.Tensor
    b: torch.Tensor
    token_slots: torch.Tensor
    slice_starts: tuple[int, ...] = ()


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, stride_xm, stride_wn, stride_om, up_offset,
    h_ptr, b_ptr, slot_ptr, s1, s2, stride_hs, stride_hm, stride_bs, stride_br,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_N: tl.constexpr, K_PAD: tl.constexpr,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
    LORA: tl.constexpr = False, R: tl.constexpr = 16, H_SPLIT: tl.constexpr = 1,
    # NORM: x is an RMSNorm's input (plus res_ptr's rows with HAS_RES): every program normalizes each row itself
    # (kernels/norm._normalize, the norm kernel's numbers) and the first stores the norm's outputs.
    res_ptr=None, nw_ptr=None, normed_ptr=None, new_res_ptr=None, eps=0.0, stride_rm=0, stride_nm=0,
    NORM: tl.constexpr = False, HAS_RES: tl.constexpr = False, FP32_PRODUCT: tl.constexpr = False,
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
        # The slot table and B are written before the forward starts: row 0's B tile loads before the wait too.
        offs_r = tl.arange(0, R)
        b_mask = (offs_r < R)[:, None] & row_ok[None, :]
        b_ptrs = b_ptr + offs_r[:, None] * stride_br + rows[None, :]  # [R, BLOCK_N]; + the slot's offset
        if GATED:
            h_idx = offs_r[:, None] + 0 * rows[None, :]  # the gate's shrink; the up's is R further
        else:
            h_idx = ((rows >= s1).to(tl.int32) + (rows >= s2).to(tl.int32))[None, :] * R + offs_r[:, None]
        slot = tl.load(slot_ptr)
        b = tl.load(b_ptrs + tl.maximum(slot, 0).to(tl.int64) * stride_bs, mask=b_mask & (slot >= 0), other=0.0)
        if GATED:
            b_up = tl.load(b_ptrs + tl.maximum(slot, 0).to(tl.int64) * stride_bs + N, mask=b_mask & (slot >= 0),
                           other=0.0)
    if NORM:
        nw = tl.load(nw_ptr + cols, mask=col_ok, other=0.0)
    wait_prior_kernel(USE_PDL)
    out_ty = out_ptr.dtype.element_ty
    x_next = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
    if HAS_RES:
        r_next = tl.load(res_ptr + cols, mask=col_ok, other=0.0)
    first = tl.program_id(0) == 0
    for m in range(M):  # a runtime count: one compiled variant for one row and one for several
        if NORM:
            xs = x_next
            if HAS_RES:  # the sum rounded to the activation dtype first, as the norm kernel
                xs = (x_next.to(tl.float32) + r_next.to(tl.float32)).to(x_ptr.dtype.element_ty)
                tl.store(new_res_ptr + m * stride_rm + cols, xs, mask=col_ok & first)
            y = _normalize(xs, nw, K, eps, FP32_PRODUCT).to(normed_ptr.dtype.element_ty)
            tl.store(normed_ptr + m * stride_nm + cols, y, mask=col_ok & first)
            x = y.to(tl.float32)
        else:
            x = x_next.to(tl.float32)
        # The next row's load is in flight while this row is reduced, hiding its L2 latency.
        x_next = tl.load(x_ptr + (m + 1) * stride_xm + cols, mask=col_ok & (m + 1 < M), other=0.0)
        if HAS_RES:
            r_next = tl.load(res_ptr + (m + 1) * stride_rm + cols, mask=col_ok & (m + 1 < M), other=0.0)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_BIAS:
            acc += bias
        if GATED:
            acc_up = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
            if HAS_BIAS:
                acc_up += bias_up
        if LORA:
            if m > 0:
                slot = tl.load(slot_ptr + m)
                b = tl.load(b_ptrs + tl.maximum(slot, 0).to(tl.int64) * stride_bs, mask=b_mask & (slot >= 0),
                            other=0.0)
                if GATED:
                    b_up = tl.load(b_ptrs + tl.maximum(slot, 0).to(tl.int64) * stride_bs + N,
                                   mask=b_mask & (slot >= 0), other=0.0)
            h_mask = b_mask & (slot >= 0)  # a row without an adapter: h unset, B zeros
            h = tl.zeros((R, BLOCK_N), dtype=tl.float32)
            for sp in range(H_SPLIT):
                h += tl.load(h_ptr + sp * stride_hs + m * stride_hm + h_idx, mask=h_mask, other=0.0)
            acc += tl.sum(b.to(tl.float32) * h, axis=0)
            if GATED:
                h_up = tl.zeros((R, BLOCK_N), dtype=tl.float32)
                for sp in range(H_SPLIT):
                    h_up += tl.load(h_ptr + sp * stride_hs + m * stride_hm + R + h_idx, mask=h_mask, other=0.0)
                acc_up += tl.sum(b_up.to(tl.float32) * h_up, axis=0)
        if GATED:
            gate = acc.to(out_ty).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
            acc = act * acc_up.to(out_ty).to(tl.float32)
        tl.store(out_ptr + m * stride_om + rows, acc.to(out_ty), mask=row_ok)


# The LM head's one-row product runs eagerly on every decode step: launched directly.
_gemv = direct(_gemv_kernel)


def gemv_max_rows() -> int:
    """Most rows (tokens) for which the linear layers use this kernel instead of cuBLAS; 0 turns it off."""
    return envs.PAGEDLLM_GEMV_MAX_ROWS


# Above this many weight elements the kernel is used for one row only. Each extra row costs the kernel a full pass
# of multiply-adds and a cross-warp reduction over its register tile; on a large weight that outweighs what it gains
# over cuBLAS, and past 4 rows cuBLAS wins at every size, hence PAGEDLLM_GEMV_MAX_ROWS=4 (benchmarks/gemv.py
# --chain-only; numbers in docs/benchmarks.md, GPU section).
MULTI_ROW_MAX_WEIGHT = 8 * 1024 * 1024


def mma_max_rows() -> int:
    """Most rows (from 2) for which the layers use the tensor-core GEMV (kernels/gemv_mma.py); 0 turns it off."""
    from pagedllm.kernels.gemv_mma import MAX_ROWS

    return min(envs.PAGEDLLM_GEMV_MMA_MAX_ROWS, MAX_ROWS)


_MMA_DEVICES: dict = {}


def _mma_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The tensor-core GEMV can take this product: a GPU it runs on, a weight it reads, x rows 16-byte aligned."""
    from pagedllm.kernels import gemv_mma

    ok = _MMA_DEVICES.get(x.device)
    if ok is None:
        ok = _MMA_DEVICES[x.device] = gemv_mma.kernel_available(x.device) is None
    return (ok and gemv_mma.layout_problem(weight) is None and x.data_ptr() % 16 == 0
            and (x.stride(0) % 8 == 0 or x.shape[0] == 1))


def disable_mma(device: torch.device) -> None:
    """Take the tensor-core GEMV off this device's layers (it failed to build there)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    _MMA_DEVICES[torch.device("cuda", index)] = False


def _rows_kernel(rows: int, weight: torch.Tensor, x: Optional[torch.Tensor] = None) -> Optional[str]:
    """Which few-row kernel takes `rows` rows of this weight: "mma" (2 to PAGEDLLM_GEMV_MMA_MAX_ROWS rows, when the
    tensor-core GEMV can read the weight and x), "gemv" (one row; up to PAGEDLLM_GEMV_MAX_ROWS rows for weights of
    at most MULTI_ROW_MAX_WEIGHT elements), or None (cuBLAS). (A Triton skinny GEMM for 2..16 rows lost to cuBLAS
    on the H200 and was deleted: docs/benchmarks.md, the seven GPU switches.)"""
    if rows == 0:
        return None
    if 2 <= rows <= mma_max_rows() and x is not None and _mma_applies(x, weight):
        return "mma"
    if (rows <= gemv_max_rows() and (rows == 1 or weight.numel() <= MULTI_ROW_MAX_WEIGHT)
            and weight.shape[1] <= GEMV_MAX_K):
        return "gemv"
    return None


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, lora: bool = False) -> bool:
    """Whether `gemv` handles `x @ weight.T`: CUDA, fp16/bf16, contiguous rows, and few rows of a weight one of the
    few-row kernels takes (`_rows_kernel`: the Triton GEMV needs a K that fits one program). lora: with a LoRA delta
    to add (the Triton GEMV's rows only)."""
    if not (x.is_cuda and x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype
            and x.dtype in (torch.float16, torch.bfloat16) and weight.stride(1) == 1 and x.stride(1) == 1
            and not x.requires_grad):
        return False
    return _rows_kernel(x.shape[0], weight, None if lora else x) is not None


def gemv_block_n(n: int, k: int) -> int:
    k_pad = triton.next_power_of_2(k)
    return max(1, min(triton.next_power_of_2(n), _TILE_ELEMENTS // k_pad))


@dataclass
class GemvNorm:
    """An RMSNorm for `gemv` to apply to x first (x + residual, normalized, times weight: kernels/norm.py's
    numbers); `gemv` writes its outputs to `out` (the normalized rows) and `residual_out` (x + residual)."""

    weight: torch.Tensor
    eps: float
    fp32_product: bool
    out: torch.Tensor
    residual: Optional[torch.Tensor] = None
    residual_out: Optional[torch.Tensor] = None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, gated: bool = False,
         block_n: Optional[int] = None, num_warps: int = 8, lora: Optional[GemvLoRA] = None,
         mma: Optional[bool] = None, norm: Optional[GemvNorm] = None) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] (gated: [2 * N', K], gate rows then up rows). Returns [M, N] (gated: [M, N']),
    with `lora`'s delta added to each row before the rounding (and the activation). mma: the tensor-core GEMV
    (kernels/gemv_mma.py) instead of this kernel; None: where `_rows_kernel` gives it the rows. norm: x is the
    input of that RMSNorm, whose output the product takes (this kernel only)."""
    if mma is None:
        mma = (lora is None and norm is None and block_n is None
               and _rows_kernel(x.shape[0], weight, x) == "mma")
    assert not (mma and norm is not None), "the tensor-core GEMV takes no norm"
    if mma and (not gated or weight.shape[0] % 32 == 0):
        from pagedllm.kernels.gemv_mma import gemv_mma

        return gemv_mma(x, weight, bias, gated=gated)
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
    lora_args, lora_meta = (x, x, x, 0, 0, 0, 0, 0, 0), {}  # (unread)
    if lora is not None:
        h, b, slots = lora.h, lora.b, lora.token_slots
        r = b.shape[1]
        starts = [n] if gated else list(lora.slice_starts)
        assert b.is_contiguous() and b.shape[2] == n_total and h.stride(-1) == 1 and slots.numel() >= m, (
            b.shape, h.shape, n_total)
        assert h.shape[1] >= m and h.shape[2] == (len(starts) + 1) * r and len(starts) <= 2, (h.shape, starts, r)
        assert r == triton.next_power_of_2(r), r
        starts += [n_total] * (2 - len(starts))
        lora_args = (h, b, slots, starts[0], starts[1], h.stride(0), h.stride(1), b.stride(0), b.stride(1))
        lora_meta = dict(LORA=True, R=r, H_SPLIT=h.shape[0])
    # (read only with a norm)
    norm_args = dict(res_ptr=x, nw_ptr=x, normed_ptr=x, new_res_ptr=x, eps=0.0, stride_rm=0, stride_nm=0)
    if norm is not None:
        res, res_out = norm.residual, norm.residual_out
        assert norm.weight.shape == (k,) and norm.out.shape == x.shape and norm.out.stride(1) == 1, norm.out.shape
        assert res is None or (res.shape == x.shape and res.stride(1) == 1 and res_out is not None
                               and res_out.shape == x.shape and res_out.stride(1) == 1), (x.shape, res_out)
        assert res is None or res_out.stride(0) == res.stride(0), "residual rows share one stride"
        norm_args = dict(res_ptr=res if res is not None else x, nw_ptr=norm.weight, normed_ptr=norm.out,
                         new_res_ptr=res_out if res is not None else norm.out, eps=norm.eps,
                         stride_rm=res.stride(0) if res is not None else 0, stride_nm=norm.out.stride(0),
                         NORM=True, HAS_RES=res is not None, FP32_PRODUCT=norm.fp32_product)
    _gemv[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out,
        m, x.stride(0), weight.stride(0), out.stride(0), n * weight.stride(0), *lora_args,
        N=n, K=k, BLOCK_N=block_n, K_PAD=triton.next_power_of_2(k),
        GATED=gated, HAS_BIAS=bias is not None, num_warps=num_warps, **lora_meta, **norm_args,
        **pdl_launch_args(x.device))
    return out


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
             gated: bool = False) -> torch.Tensor:
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if not gated:
        return y.to(x.dtype)
    n = weight.shape[0] // 2
    gate, up = y[:, :n].to(x.dtype), y[:, n:].to(x.dtype)
    return (torch.nn.functional.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
