"""Write this step's new K/V rows into the paged KV cache through `slot_mapping`.

KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_size] (0 = K, 1 = V).
`slot_mapping[t] = block_id * block_size + offset` is the cache slot of input row t.

Padding contract (CUDA graphs). The kernel's grid covers every input row (`key.shape[0]`), so it
never depends on a host count that changes between graph replays. Rows beyond
`num_actual_tokens` (CUDA-graph padding) must therefore carry a harmless slot: the runner points
them at a scratch slot it reserved (e.g. block 0 kept out of the free pool as a "null block").
As a safety net only, rows whose slot is negative are skipped, so a runner that pads with a
negative slot also works; the engine's own convention is the reserved scratch slot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_size], last dim contiguous
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE
    BLOCK_H: tl.constexpr,  # kv heads per program
    USE_PDL: tl.constexpr,
):
    wait_prior_kernel(USE_PDL)
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # safety net for negative padding slots (see module docstring)
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_SIZE)[None, :]

    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token64 * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)

    dst = cache_ptr + blk * stride_c_blk + off * stride_c_slot + heads[:, None] * stride_c_head + dims[None, :]
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Scatter every row of key/value into kv_cache at slot_mapping (in place, graph-capturable)."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert value.shape == key.shape, (value.shape, key.shape)
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_size dim must be contiguous"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.stride(-1) == 1
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_size, (kv_cache.shape, key.shape)
    assert slot_mapping.shape[0] >= num_tokens
    block_size = kv_cache.shape[2]
    head_pad = triton.next_power_of_2(head_size)
    # Keep one program's tile at <= 4096 elements.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_H=block_h,
        num_warps=4 if block_h * head_pad >= 1024 else 2,
        **pdl_launch_args(key.device),
    )


def reshape_and_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Pure-torch reference: same contract as `reshape_and_cache` (negative slots skipped)."""
    num_tokens = key.shape[0]
    block_size = kv_cache.shape[2]
    slots = slot_mapping[:num_tokens].long()
    keep = slots >= 0
    slots = slots[keep]
    blk, off = slots // block_size, slots % block_size
    kv_cache[0, blk, off] = key[keep].to(kv_cache.dtype)
    kv_cache[1, blk, off] = value[keep].to(kv_cache.dtype)
