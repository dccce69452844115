"""Fused RMSNorm kernels (Triton) and torch references.

Numerics follow HF's LlamaRMSNorm exactly: the input is upcast to fp32, normalized, cast back to
the input dtype, and only then multiplied by the weight (a product rounded to the output dtype).
The fused variant first adds the residual in the input dtype (as HF's `residual + hidden_states`),
returns that sum as the new residual, and normalizes it. With `fp32_product` (Gemma's (1 + w) norms, whose
float32 weight already holds 1 + w) the normalized value is not rounded before the weight: the product is taken
in float32 and rounded once to the input dtype, as HF's Gemma*RMSNorm computes it.

`rms_norm_shrink` also multiplies each normalized row by a per-row slice of a projection (a LoRA adapter's A of
the layer the norm feeds), so a decode step's shrink costs no launch of its own.

`rms_norm_quant` also quantizes each output row per token (FP8 E4M3 or int8, the numbers of
`kernels/quant_act`'s kernel applied to the output) for the W8A8 layer the norm feeds: no launch and no pass over
the activations of its own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel
from pagedllm.kernels.quant_act import _INV_QMAX, FP8_MAX, _quantize, _row_scale


@triton.jit
def _normalize(x, w, hidden, eps, FP32_PRODUCT: tl.constexpr):
    """x / rms(x) * w in float32 (x rounded to its dtype after the division unless FP32_PRODUCT)."""
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    if not FP32_PRODUCT:
        normed = normed.to(x.dtype).to(tl.float32)
    return normed * w.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, q_ptr, scale_ptr,
    stride_x, stride_r, stride_o, stride_ro, stride_q,
    hidden, eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FP32_PRODUCT: tl.constexpr,
    QUANT: tl.constexpr,  # the output also quantized per token: int8 (INT8) or FP8 E4M3, QMAX 127.0 / 448.0
    INT8: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_prior_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype first, like the unfused model code.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = _normalize(x, w, hidden, eps, FP32_PRODUCT).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    if QUANT:  # the stored values, quantized as quant_act's kernel would after this one (the same bits)
        yf = tl.where(mask, y.to(tl.float32), 0.0)
        scale = _row_scale(tl.abs(yf), INV_QMAX)
        tl.store(q_ptr + row * stride_q + cols, _quantize(yf, scale, QMAX, INT8).to(q_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(scale_ptr + row, scale)


@triton.jit
def _rms_norm_shrink_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, a_ptr, slot_ptr, h_ptr,
    stride_x, stride_r, stride_o, stride_ro, stride_as, stride_an, stride_hm,
    hidden, eps, NR,
    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, FP32_PRODUCT: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (row, p): the norm of `row` (every program of the row computes it; the first one stores it) and
    h[row, p*BLOCK_P:(p+1)*BLOCK_P] = A[slot(row)][those rows] @ norm(row), fp32 (zeros for rows without a slot)."""
    row = tl.program_id(0).to(tl.int64)
    pid_p = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = offs_p < NR
    # The slot table and A are written before the forward starts, never by the previous kernel: load A before
    # the PDL wait, overlapping the previous kernel's tail.
    slot = tl.load(slot_ptr + row)
    a = tl.load(a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_as + offs_p[:, None] * stride_an + cols[None, :],
                mask=p_ok[:, None] & mask[None, :] & (slot >= 0), other=0.0)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    wait_prior_kernel(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if pid_p == 0:
            tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    y = _normalize(x, w, hidden, eps, FP32_PRODUCT).to(out_ptr.dtype.element_ty)
    if pid_p == 0:
        tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    # The projection reads what the next layer reads: the norm's output rounded to its dtype.
    h = tl.sum(a.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)
    tl.store(h_ptr + row * stride_hm + offs_p, h.to(h_ptr.dtype.element_ty), mask=p_ok)


# Projection weight elements held by one program of rms_norm_shrink (registers), as the GEMV's tile.
_SHRINK_TILE_ELEMENTS = 16384


def rms_norm_shrink(x: torch.Tensor, residual, weight: torch.Tensor, eps: float, fp32_product: bool,
                    a: torch.Tensor, token_slots: torch.Tensor, h_dtype: torch.dtype = torch.float32):
    """(RMSNorm of x (+ residual), the new residual or None, h): h [1, T, NR] = A[slot(t)] @ out[t] for each row t
    of x [T, hidden] (a [S, NR, hidden] contiguous, token_slots [>= T] int32, -1: no adapter, zeros), summed in fp32
    and stored as h_dtype (fp32: a LoRA shrink; the activation dtype: a projection such as a MoE router)."""
    hidden = x.shape[-1]
    assert x.dim() == 2 and weight.shape == (hidden,) and a.is_contiguous() and a.shape[2] == hidden, (x.shape, a.shape)
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    rows, nr = x2.shape[0], a.shape[1]
    out_dtype = x.dtype if fp32_product else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty((rows, hidden), dtype=out_dtype, device=x.device)
    h = torch.empty((1, rows, nr), dtype=h_dtype, device=x.device)
    if residual is not None:
        r2 = residual if residual.stride(-1) == 1 else residual.contiguous()
        r_out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    else:
        r2, r_out = x2, out
    if rows > 0:
        block = triton.next_power_of_2(hidden)
        block_p = max(1, min(triton.next_power_of_2(nr), _SHRINK_TILE_ELEMENTS // block))
        _rms_norm_shrink_kernel[(rows, triton.cdiv(nr, block_p))](
            x2, r2, weight, out, r_out, a, token_slots, h,
            x2.stride(0), r2.stride(0), out.stride(0), r_out.stride(0), a.stride(0), a.stride(1), h.stride(1),
            hidden, eps, nr, BLOCK=block, BLOCK_P=block_p, HAS_RESIDUAL=residual is not None,
            FP32_PRODUCT=fp32_product, num_warps=8, **pdl_launch_args(x.device))
    return out, (r_out if residual is not None else None), h


def _launch(x: torch.Tensor, residual, weight: torch.Tensor, eps: float, fp32_product: bool = False,
            quant_dtype=None):
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), (weight.shape, hidden)
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out_dtype = x.dtype if fp32_product else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty((rows, hidden), dtype=out_dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        r_out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    else:
        r2, r_out = x2, out
    quant = None
    if quant_dtype is not None:
        assert quant_dtype in (torch.int8, torch.float8_e4m3fn), quant_dtype
        quant = (torch.empty((rows, hidden), dtype=quant_dtype, device=x.device),
                 torch.empty((rows, 1), dtype=torch.float32, device=x.device))
    if rows > 0:
        block = triton.next_power_of_2(hidden)
        num_warps = min(16, max(1, block // 256))
        qmax = 127.0 if quant_dtype == torch.int8 else FP8_MAX
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, r_out, out if quant is None else quant[0], out if quant is None else quant[1],
            x2.stride(0), r2.stride(0), out.stride(0), r_out.stride(0),
            hidden if quant is None else quant[0].stride(0), hidden, eps, BLOCK=block,
            HAS_RESIDUAL=residual is not None, FP32_PRODUCT=fp32_product, QUANT=quant is not None,
            INT8=quant_dtype == torch.int8, QMAX=qmax, INV_QMAX=_INV_QMAX[qmax], num_warps=num_warps,
            **pdl_launch_args(x.device),
        )
    out = out.view(*x.shape[:-1], hidden)
    return out, (r_out.view(*x.shape[:-1], hidden) if residual is not None else None), quant


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_product: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim. x: [..., hidden]; weight: [hidden]. Returns a new tensor."""
    return _launch(x, None, weight, eps, fp32_product)[0]


def rms_norm_quant(x: torch.Tensor, residual, weight: torch.Tensor, eps: float, fp32_product: bool,
                   quant_dtype: torch.dtype):
    """`rms_norm` (residual None) or `fused_add_rms_norm`, the output also quantized per token into quant_dtype
    (torch.float8_e4m3fn or torch.int8, dynamic scales: what kernels/quant_act gives for that output, bit for bit).
    -> (out [..., hidden], new residual or None, (x_q [rows, hidden], x_scale fp32 [rows, 1]))."""
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape)
    return _launch(x, residual, weight, eps, fp32_product, quant_dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, fp32_product: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual'). Inputs are not modified."""
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape)
    out, new_residual, _ = _launch(x, residual, weight, eps, fp32_product)
    return out, new_residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_product: bool = False) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if fp32_product:
        return (normed * weight.float()).to(x.dtype)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float, fp32_product: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps, fp32_product), new_residual
