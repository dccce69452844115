"""CPU paged attention through the C++ kernels (kernels/csrc/cpu_ops.cpp): the default backend on CPU.

Per layer and step, two calls: `write_kv` scatters the new tokens' K/V into their slots, and
`paged_attention` attends every query token of the mixed batch (decodes, prefill chunks, prefix hits) to its
context read straight through the block table, with no gather of K/V into a padded copy and no mask tensor.
Blocks are stored in this backend's own layout (head-major, K transposed: see cpu_ops.cpp); nothing outside
the backend reads the pool's contents, so the layout is private to it.
The torch backend (attention/torch_backend.py) computes the same thing and is what the tests compare with.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.torch_backend import chunk_attention, chunk_mask, effective_window, window_key_start
from pagedllm.forward_context import AttentionMetadata
from pagedllm.kernels.cpu_ops import cpu_ops


# Prefill chunks of at least this many query tokens are attended by a gather + torch's flash-attention SDPA:
# faster than the C++ kernel for long chunks, slower for short ones (docs/benchmarks.md, CPU section).
LONG_QUERY_LEN = 1024


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    # The kernels read only slots that were written (invisible lanes are selected away, never multiplied),
    # so the pool may start as uninitialized memory.
    needs_zeroed_cache = False
    # Soft-capped layers (Gemma 2): the C++ kernel caps its scores, the gathered long chunks cap in torch.
    supports_logits_soft_cap = True

    def __init__(self) -> None:
        self.ops = cpu_ops()
        if self.ops is None:
            raise RuntimeError("The 'cpu' attention backend needs the pagedllm CPU kernels, which could not be "
                               "built here (see the warning above); use attention_backend='torch'.")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: Optional[int] = None,
                logits_soft_cap: Optional[float] = None) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        # The pool is [2, blocks, block_size, Hk, D]; this backend keeps each block head-major with K
        # transposed (see cpu_ops.cpp), a private layout of the same size.
        _, num_blocks, block_size, kv_heads, head_size = kv_cache.shape
        key_cache = kv_cache[0].view(num_blocks, kv_heads, head_size, block_size)
        value_cache = kv_cache[1].view(num_blocks, kv_heads, block_size, head_size)
        self.ops.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping, num_tokens)
        out = torch.empty(query.shape, dtype=query.dtype)
        if num_tokens < query.shape[0]:
            out[num_tokens:].zero_()
        long_rows = []
        if metadata.max_query_len >= LONG_QUERY_LEN:
            qsl = metadata.query_start_loc_cpu or metadata.query_start_loc.tolist()
            seq_lens = metadata.seq_lens_cpu or metadata.seq_lens.tolist()
            long_rows = [(qsl[i], qsl[i + 1], seq_lens[i], i) for i in range(metadata.num_reqs)
                         if qsl[i + 1] - qsl[i] >= LONG_QUERY_LEN]
        self.ops.paged_attention(out, query, key_cache, value_cache, metadata.block_table,
                                 metadata.query_start_loc, metadata.seq_lens, scale,
                                 LONG_QUERY_LEN if long_rows else 0, sliding_window or 0, logits_soft_cap or 0.0)
        for start, end, seq_len, row in long_rows:
            # A long prefill chunk: gather its context (within the window) out of the block layout, then SDPA.
            window = effective_window(sliding_window, seq_len)
            key_start = window_key_start(seq_len, end - start, window)
            first_block = key_start // block_size
            blocks = metadata.block_table[row, first_block:-(-seq_len // block_size)].long()
            n = blocks.numel() * block_size
            keys = slice(key_start - first_block * block_size, seq_len - first_block * block_size)
            # K blocks [kv_heads, D, block_size], V blocks [kv_heads, block_size, D] -> [1, kv_heads, keys, D]
            k = key_cache.index_select(0, blocks).permute(1, 0, 3, 2).reshape(kv_heads, n, head_size)[:, keys]
            v = value_cache.index_select(0, blocks).permute(1, 0, 2, 3).reshape(kv_heads, n, head_size)[:, keys]
            out[start:end] = chunk_attention(query[start:end], k.unsqueeze(0), v.unsqueeze(0),
                                             chunk_mask(end - start, seq_len, query.device, window, key_start), scale,
                                             logits_soft_cap)
        return out
