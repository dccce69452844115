"""CPU paged attention through the C++ kernels (kernels/csrc/cpu_ops.cpp): the default backend on CPU.

Per layer and step, two calls: `write_kv` scatters the new tokens' K/V into their slots, and
`paged_attention` attends every query token of the mixed batch (decodes, prefill chunks, prefix hits) to its
context read straight through the block table, with no gather of K/V into a padded copy and no mask tensor.
Blocks are stored in this backend's own layout (head-major, K transposed: see cpu_ops.cpp); nothing outside
the backend reads the pool's contents, so the layout is private to it.
The torch backend (attention/torch_backend.py) computes the same thing and is what the tests compare with.
"""
from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.forward_context import AttentionMetadata
from pagedllm.kernels.cpu_ops import cpu_ops


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    # The kernels read only slots that were written (invisible lanes are selected away, never multiplied),
    # so the pool may start as uninitialized memory.
    needs_zeroed_cache = False

    def __init__(self) -> None:
        self.ops = cpu_ops()
        if self.ops is None:
            raise RuntimeError("The 'cpu' attention backend needs the pagedllm CPU kernels, which could not be "
                               "built here (see the warning above); use attention_backend='torch'.")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
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
        self.ops.paged_attention(out, query, key_cache, value_cache, metadata.block_table,
                                 metadata.query_start_loc, metadata.seq_lens, scale)
        return out
