"""Neox-style rotary embedding (Triton), in place on q and k, and its torch reference.

cos_sin_cache: [max_position, rotary_dim] = cat(cos, sin) along the last dim (each rotary_dim/2),
fp32 or the model dtype. For each head, the first rotary_dim channels rotate as halves:
x1 = x[:rotary_dim/2], x2 = x[rotary_dim/2:rotary_dim];
x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin; channels past rotary_dim are left unchanged.
Math is done in fp32 and rounded once to the q/k dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel


@triton.jit
def _rotate(x_ptr, token, stride_t, num_heads, cos, sin,
            HEAD_SIZE: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF_PAD)
    for h0 in range(0, num_heads, BLOCK_H):
        hh = h0 + heads
        mask = (hh < num_heads)[:, None] & (cols < HALF)[None, :]
        base = x_ptr + token * stride_t + hh[:, None] * HEAD_SIZE + cols[None, :]
        x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(base, o1.to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(base + HALF, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cache_ptr,
    stride_qt, stride_kt, stride_cache,
    num_q_heads, num_k_heads,
    HEAD_SIZE: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_prior_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)
    cmask = cols < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + cols, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    _rotate(q_ptr, token, stride_qt, num_q_heads, cos, sin, HEAD_SIZE, HALF, HALF_PAD, BLOCK_H)
    _rotate(k_ptr, token, stride_kt, num_k_heads, cos, sin, HEAD_SIZE, HALF, HALF_PAD, BLOCK_H)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ([num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size]) and k
    (same, with kv heads) in place at `positions` ([num_tokens]); returns (q, k).

    Each token's heads must be laid out contiguously (row stride may be larger, e.g. views of a
    fused qkv output)."""
    num_tokens = positions.shape[0]
    rotary_dim = cos_sin_cache.shape[-1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_size, (rotary_dim, head_size)
    assert q.stride(-1) == 1 and k.stride(-1) == 1
    if q.dim() == 3:
        assert q.stride(1) == head_size and k.stride(1) == head_size
    num_q_heads = q.shape[1] * q.shape[2] // head_size if q.dim() == 3 else q.shape[-1] // head_size
    num_k_heads = k.shape[1] * k.shape[2] // head_size if k.dim() == 3 else k.shape[-1] // head_size
    assert cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    half = rotary_dim // 2
    half_pad = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), 2048 // half_pad))
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), k.stride(0), cos_sin_cache.stride(0),
        num_q_heads, num_k_heads,
        HEAD_SIZE=head_size, HALF=half, HALF_PAD=half_pad, BLOCK_H=block_h, num_warps=4,
        **pdl_launch_args(q.device),
    )
    return q, k


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place torch reference with the same numerics; returns new (q, k)."""
    rotary_dim = cos_sin_cache.shape[-1]
    half = rotary_dim // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, head_size)
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
        out = xf.clone()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rotary_dim] = x2 * cos + x1 * sin
        return out.to(x.dtype).reshape(shape)

    return rot(q), rot(k)
