"""One kernel between the qkv projection and attention: optional per-head RMSNorm of q and k (Qwen3),
neox rotary embedding of q and k, and the write of k and v into the paged KV cache.

Unfused, this is 2-4 launches per layer (q norm, k norm, rotary, KV write); at small batches each launch costs
a visible share of a decode step, so the fusion pays at every batch size.

Input: the projection output qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_size] (rows may be
strided). Effects:
  * q (the first num_heads heads of each row) is normalized (if q_norm_weight is given) and rotated IN
    PLACE;
  * k is normalized (if k_norm_weight is given), rotated and written to kv_cache[0] at slot_mapping;
  * v is written to kv_cache[1] unchanged. k and v in qkv are left as they were.
Rows whose slot is negative write nothing to the cache (see reshape_and_cache.py for the padding contract).

Numerics follow the unfused kernels: the norm rounds x * rsqrt(mean(x^2) + eps) to the activation dtype,
multiplies by the weight and rounds again (HF's RMSNorm) or, with float32 norm weights on lower-precision
activations (Gemma 3's (1 + w) q/k norms), multiplies in float32 and rounds once (HF's Gemma3RMSNorm); the rotation is done in fp32 from that value and
rounded once. Only the order in which the squares are summed differs (two half-head sums), so a value can land
one rounding away. Only rotary_dim == head_size is supported (callers fall back otherwise).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel


@triton.jit
def head_norm_product(f, rstd, w, like, FP32_PRODUCT: tl.constexpr):
    """f / rms times the norm weight as HF rounds it to `like`'s dtype (float32 out): x / rms rounded, then the
    product rounded (Llama's RMSNorm), or with FP32_PRODUCT one rounding of the float32 product (Gemma's)."""
    if FP32_PRODUCT:
        return (f * rstd * w).to(like.dtype).to(tl.float32)
    return ((f * rstd).to(like.dtype).to(tl.float32) * w).to(like.dtype).to(tl.float32)


@triton.jit
def _qkv_prep_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, cache_ptr, slot_mapping_ptr, kv_scale_ptr,
    stride_t, stride_cs, eps,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP32_PRODUCT: tl.constexpr,  # the norm's product in float32, rounded once (Gemma's (1 + w) norms)
    HAS_KV_SCALE: tl.constexpr,  # FP8 cache scales (k_scale, v_scale): K / k_scale, V / v_scale stored, q * k_scale
    USE_PDL: tl.constexpr,
):
    wait_prior_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    # Heads of a row, in qkv order: [0, NUM_Q) q, [NUM_Q, NUM_Q + NUM_KV) k, then v.
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF_PAD)
    col_ok = cols < HALF
    is_q = heads < NUM_Q
    is_v = heads >= NUM_Q + NUM_KV
    row_ok = heads < NUM_Q + 2 * NUM_KV
    mask = row_ok[:, None] & col_ok[None, :]
    base = qkv_ptr + token * stride_t + heads[:, None] * HEAD_SIZE + cols[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / HEAD_SIZE
        rstd = tl.rsqrt(var + eps)[:, None]
        wq1 = tl.load(q_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        wq2 = tl.load(q_w_ptr + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)
        wk1 = tl.load(k_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        wk2 = tl.load(k_w_ptr + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)
        w1 = tl.where(is_q[:, None], wq1[None, :], wk1[None, :])
        w2 = tl.where(is_q[:, None], wq2[None, :], wk2[None, :])
        n1 = head_norm_product(f1, rstd, w1, x1, FP32_PRODUCT)
        n2 = head_norm_product(f2, rstd, w2, x1, FP32_PRODUCT)
    else:
        n1 = f1
        n2 = f2
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    o1 = tl.where(is_v[:, None], f1, n1 * cos - n2 * sin)
    o2 = tl.where(is_v[:, None], f2, n2 * cos + n1 * sin)

    q_mask = mask & is_q[:, None]
    if HAS_KV_SCALE:
        # softmax(scale * q . (k_scale * k8)) = softmax(scale * (k_scale * q) . k8): q carries the K scale.
        k_scale = tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
        mul = tl.where(is_q, k_scale, tl.where(is_v, 1.0 / v_scale, 1.0 / k_scale))[:, None]
        o1 = o1 * mul
        o2 = o2 * mul
    tl.store(base, o1.to(x1.dtype), mask=q_mask)
    tl.store(base + HALF, o2.to(x1.dtype), mask=q_mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    kv_head = tl.where(is_v, heads - NUM_Q - NUM_KV, heads - NUM_Q)
    which = tl.where(is_v, 1, 0).to(tl.int64)
    in_block = off * stride_c_slot + kv_head[:, None] * stride_c_head + cols[None, :]
    dst = cache_ptr + blk * stride_c_blk + which[:, None] * stride_c_kv + in_block
    kv_mask = mask & (~is_q)[:, None] & (slot >= 0)
    tl.store(dst, o1.to(cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dst + HALF, o2.to(cache_ptr.dtype.element_ty), mask=kv_mask)


def _check(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int, kv_cache: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> None:
    assert qkv.dim() == 2 and qkv.stride(-1) == 1, (qkv.shape, qkv.stride())
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_size, (qkv.shape, num_heads, num_kv_heads)
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.stride(-1) == 1
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_size, kv_cache.shape
    assert cos_sin_cache.shape[-1] == head_size and cos_sin_cache.stride(-1) == 1, (
        "the fused qkv kernel needs rotary_dim == head_size", cos_sin_cache.shape, head_size)
    assert head_size % 2 == 0


def qkv_prep(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_size]
    positions: torch.Tensor,  # [num_tokens]
    cos_sin_cache: torch.Tensor,  # [max_position, head_size] = cat(cos, sin)
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [>= num_tokens] int64
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    q_norm_weight: Optional[torch.Tensor] = None,  # [head_size] (both or neither)
    k_norm_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    kv_scales: Optional[torch.Tensor] = None,  # float32 [2]: an FP8 cache's (k_scale, v_scale)
) -> torch.Tensor:
    """Normalize (optional) + rotate q in place, write rotated k and v to the cache; returns q as a
    [num_tokens, num_heads, head_size] view of qkv. With kv_scales the cache gets K / k_scale and V / v_scale and
    q is returned times k_scale (attention over the cache then needs only its output times v_scale)."""
    _check(qkv, num_heads, num_kv_heads, head_size, kv_cache, cos_sin_cache)
    num_tokens = qkv.shape[0]
    q = qkv[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    has_norm = q_norm_weight is not None
    assert has_norm == (k_norm_weight is not None)
    # float32 weights on bf16/fp16 activations are Gemma's (1 + w) norms: HF takes their product in float32
    fp32_product = has_norm and q_norm_weight.dtype == torch.float32 and qkv.dtype != torch.float32
    assert not has_norm or k_norm_weight.dtype == q_norm_weight.dtype, (q_norm_weight.dtype, k_norm_weight.dtype)
    if num_tokens == 0:
        return q
    total_heads = num_heads + 2 * num_kv_heads
    half = head_size // 2
    half_pad = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(total_heads), max(1, 512 // half_pad))
    grid = (num_tokens, triton.cdiv(total_heads, block_h))
    _qkv_prep_kernel[grid](
        qkv, positions, cos_sin_cache,
        q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,
        kv_cache, slot_mapping, kv_scales if kv_scales is not None else qkv,
        qkv.stride(0), cos_sin_cache.stride(0), eps,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_Q=num_heads, NUM_KV=num_kv_heads, BLOCK_H=block_h, HEAD_SIZE=head_size, HALF=half,
        HALF_PAD=half_pad, BLOCK_SIZE=kv_cache.shape[2], HAS_NORM=has_norm, FP32_PRODUCT=fp32_product,
        HAS_KV_SCALE=kv_scales is not None, num_warps=2,
        **pdl_launch_args(qkv.device),
    )
    return q


def qkv_prep_ref(
    qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int,
    q_norm_weight: Optional[torch.Tensor] = None, k_norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
) -> torch.Tensor:
    """Torch reference built from the unfused references: same contract as `qkv_prep`."""
    from pagedllm.kernels.norm import rms_norm_ref
    from pagedllm.kernels.reshape_and_cache import reshape_and_cache_ref
    from pagedllm.kernels.rotary import apply_rotary_ref

    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_size)
    k = k.reshape(num_tokens, num_kv_heads, head_size)
    if q_norm_weight is not None:
        fp32_product = q_norm_weight.dtype == torch.float32 and qkv.dtype != torch.float32
        q = rms_norm_ref(q, q_norm_weight, eps, fp32_product)
        k = rms_norm_ref(k, k_norm_weight, eps, fp32_product)
    q, k = apply_rotary_ref(positions, q, k, cos_sin_cache, head_size)
    reshape_and_cache_ref(k, v.reshape(num_tokens, num_kv_heads, head_size), kv_cache, slot_mapping)
    qkv[:, :q_size] = q.reshape(num_tokens, q_size)
    return qkv[:, :q_size].view(num_tokens, num_heads, head_size)
