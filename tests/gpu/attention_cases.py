"""Builders for paged-attention test batches (shared by the GPU tests and the kernel benchmarks).

Not a test module: pytest collects only test_*.py.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

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


def config_ids(configs) -> list[str]:
    """Test ids of (head_size, num_heads, num_kv_heads, block_size, dtype) configs."""
    return [f"d{d}-h{h}-kv{kv}-bs{bs}-{str(dt).split('.')[-1]}" for d, h, kv, bs, dt in configs]


def reference(batch: Batch, sliding_window=None, logits_soft_cap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention output, KV cache) of the torch references: the batch's new K/V written into a copy of its cache
    (the batch's own cache is left as it is), then attention over that copy."""
    # Imported here: they need triton, and test modules on CPU-only installs import build_batch from this file.
    from pagedllm.kernels.paged_attention import paged_attention_ref
    from pagedllm.kernels.reshape_and_cache import reshape_and_cache_ref

    md = batch.metadata
    ref_cache = batch.kv_cache.clone()
    reshape_and_cache_ref(batch.key, batch.value, ref_cache, md.slot_mapping)
    out = paged_attention_ref(batch.query, ref_cache, md.block_table, md.seq_lens, md.query_start_loc, batch.scale,
                              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    return out, ref_cache


class DecodeGraphInputs(NamedTuple):
    """The static buffers of one captured decode forward (what a model runner keeps per graph bucket), which the
    test refills in place before each replay, and the backend that runs it (its workspace reserved)."""
    q: torch.Tensor  # [num_seqs, H, D]
    k: torch.Tensor  # [num_seqs, KVH, D]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_seqs * max_blocks + 1, block_size, KVH, D], NaN (block 0 never handed out)
    out: torch.Tensor  # like q
    metadata: AttentionMetadata  # one token per request; block_table [num_seqs, max_seq_len / block_size]
    backend: Any  # TritonAttentionBackend


def decode_graph_inputs(num_seqs, num_heads, num_kv_heads, head_size, block_size, dtype, max_seq_len
                        ) -> DecodeGraphInputs:
    from pagedllm.attention.triton_backend import TritonAttentionBackend  # needs triton (see `reference`)

    max_blocks = max_seq_len // block_size
    num_blocks = num_seqs * max_blocks + 1
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype,
                          device="cuda")
    q = torch.zeros(num_seqs, num_heads, head_size, dtype=dtype, device="cuda")
    k = torch.zeros(num_seqs, num_kv_heads, head_size, dtype=dtype, device="cuda")
    md = AttentionMetadata(
        num_actual_tokens=num_seqs, num_reqs=num_seqs, max_query_len=1, max_seq_len=max_seq_len,
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.ones(num_seqs, dtype=torch.int32, device="cuda"),
        block_table=torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device="cuda"))
    backend = TritonAttentionBackend()
    backend.reserve_workspace(num_heads, num_kv_heads, head_size, torch.device("cuda"))
    return DecodeGraphInputs(q, k, torch.zeros_like(k), kv_cache, torch.empty_like(q), md, backend)


def capture_graph(forward) -> "torch.cuda.CUDAGraph":
    """Run `forward` once on a side stream (it compiles the kernels: no compilation inside a capture), then capture
    it into a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph
