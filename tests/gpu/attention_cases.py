"""Builders for paged-attention test batches (shared by the GPU tests and the kernel benchmarks).

Not a test module: pytest collects only test_*.py.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from pagedllm.forward_context import AttentionMetadata


def kernel_test_device() -> str:
    """'cuda' on the GPU machine; PAGEDLLM_TEST_DEVICE=cpu (with TRITON_INTERPRET=1) runs the
    kernels in Triton's interpreter on the CPU, for debugging without a GPU."""
    return os.environ.get("PAGEDLLM_TEST_DEVICE", "cuda")


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D] (a view into a fused qkv tensor)
    key: torch.Tensor  # [T, KVH, D]
    value: torch.Tensor  # [T, KVH, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D]; prefixes written, the rest NaN
    metadata: AttentionMetadata
    scale: float


def build_batch(specs, num_heads, num_kv_heads, head_size, block_size, dtype, device, seed=0,
                poison=True, extra_blocks=4) -> Batch:
    """specs: list of (cached_len, query_len). Blocks are scattered at random (block 0 is left as a
    scratch block); every slot not holding real context is NaN so stray reads show up."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(specs)
    seq_lens = [c + q for c, q in specs]
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    fill = float("nan") if poison else 0.0
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), fill, dtype=dtype, device=device)
    max_blocks = max(max(blocks_per_seq), 1) + 2
    block_table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    new_slots = []
    for i, ((cached, qlen), nblk) in enumerate(zip(specs, blocks_per_seq)):
        blocks = torch.tensor([perm.pop() for _ in range(nblk)], dtype=torch.int64)
        block_table[i, :nblk] = blocks.to(torch.int32)
        pos = torch.arange(cached + qlen)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        if cached:
            flat[:, slots[:cached].to(device)] = torch.randn(2, cached, num_kv_heads, head_size,
                                                             device=device).to(dtype)
        new_slots.append(slots[cached:])
    num_tokens = sum(q for _, q in specs)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, device=device).to(dtype)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    query = qkv[:, :q_size].view(num_tokens, num_heads, head_size)
    key = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_size)
    qsl = [0]
    for _, q in specs:
        qsl.append(qsl[-1] + q)
    md = AttentionMetadata(
        num_actual_tokens=num_tokens, num_reqs=num_seqs, max_query_len=max(q for _, q in specs),
        max_seq_len=max(seq_lens), query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_table=block_table.to(device),
        slot_mapping=torch.cat(new_slots).to(device), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    return Batch(query, key, value, kv_cache, md, head_size ** -0.5)


def tolerances(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return dict(atol=1e-4, rtol=1e-4)
    return dict(atol=1.5e-2, rtol=1.5e-2)
