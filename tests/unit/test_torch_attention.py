"""The torch paged-attention backend against a naive per-request attention over contiguous K/V."""
import math
import random

import pytest
import torch

from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.forward_context import AttentionMetadata


def naive_attention(q, k, v, scale):
    # q: [Q, H, D] (last Q positions of the context), k/v: [S, KVH, D]
    Q, H, D = q.shape
    S, KVH, _ = k.shape
    g = H // KVH
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), k.double()) * scale
    qpos = torch.arange(Q)[:, None] + (S - Q)
    mask = torch.arange(S)[None, :] <= qpos
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,block_size", [(4, 4, 16, 4), (8, 2, 32, 16), (6, 1, 8, 8)])
def test_mixed_batch_matches_naive(num_heads, num_kv_heads, head_size, block_size):
    torch.manual_seed(0)
    rng = random.Random(0)
    num_blocks = 64
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size)
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    # (context already cached, new query tokens): decode, prefill, prefix-hit chunk, decode at block edge
    shapes = [(7, 1), (0, 13), (block_size * 2, 5), (block_size - 1, 1), (3, 9), (0, 1)]
    full_k, full_v, block_tables, q_chunks, k_new, v_new, slots = [], [], [], [], [], [], []
    for cached, new in shapes:
        seq_len = cached + new
        blocks = [free_blocks.pop() for _ in range(math.ceil(seq_len / block_size))]
        block_tables.append(blocks)
        k = torch.randn(seq_len, num_kv_heads, head_size)
        v = torch.randn(seq_len, num_kv_heads, head_size)
        full_k.append(k)
        full_v.append(v)
        for pos in range(seq_len):
            b, off = blocks[pos // block_size], pos % block_size
            if pos < cached:  # already in the cache
                kv_cache[0, b, off] = k[pos]
                kv_cache[1, b, off] = v[pos]
            else:
                slots.append(b * block_size + off)
        k_new.append(k[cached:])
        v_new.append(v[cached:])
        q_chunks.append(torch.randn(new, num_heads, head_size))
    max_blocks = max(len(b) for b in block_tables)
    bt = torch.zeros(len(shapes), max_blocks, dtype=torch.int32)
    for i, b in enumerate(block_tables):
        bt[i, :len(b)] = torch.tensor(b)
    qsl = [0]
    for _, new in shapes:
        qsl.append(qsl[-1] + new)
    seq_lens = [c + n for c, n in shapes]
    md = AttentionMetadata(num_actual_tokens=qsl[-1], num_reqs=len(shapes), max_query_len=max(n for _, n in shapes),
                           max_seq_len=max(seq_lens), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                           seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=bt,
                           slot_mapping=torch.tensor(slots), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    scale = head_size ** -0.5
    out = TorchAttentionBackend().forward(torch.cat(q_chunks), torch.cat(k_new), torch.cat(v_new), kv_cache, md, scale)
    for i in range(len(shapes)):
        ref = naive_attention(q_chunks[i], full_k[i], full_v[i], scale)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref, atol=1e-5, rtol=1e-4)
    # New K/V landed in their slots.
    flat_k = kv_cache[0].reshape(-1, num_kv_heads, head_size)
    torch.testing.assert_close(flat_k[torch.tensor(slots)], torch.cat(k_new))
