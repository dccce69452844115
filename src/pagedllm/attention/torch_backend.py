"""Pure-PyTorch paged attention: the CPU path and the reference every GPU kernel is checked against.

One call handles a batch that mixes decodes (query_len == 1), prefill chunks and prefix-cache hits:
  * all decode rows are done together: their blocks are gathered into one padded [B, L] context and
    attended with a length mask (one gather + one SDPA per layer, however many requests);
  * each prefill row gathers its own context and attends causally with the chunk's offset.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend
from pagedllm.forward_context import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, num_tokens: int) -> None:
    """Scatter this step's K/V ([T, KVH, D]) into their slots of the paged cache."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    slots = slot_mapping[:num_tokens]
    flat[0].index_copy_(0, slots, key[:num_tokens])
    flat[1].index_copy_(0, slots, value[:num_tokens])


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._plan_key = None
        self._plan = None

    def _make_plan(self, metadata: AttentionMetadata):
        """Host-side split of the batch into decode rows and prefill rows (shared by all layers)."""
        if self._plan_key is metadata:
            return self._plan
        qsl = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        if qsl is None or seq_lens is None:
            qsl = metadata.query_start_loc.tolist()
            seq_lens = metadata.seq_lens.tolist()
        decode_rows, prefill_rows = [], []
        for i in range(metadata.num_reqs):
            (decode_rows if qsl[i + 1] - qsl[i] == 1 else prefill_rows).append(i)
        decode = None
        if decode_rows:
            device = metadata.block_table.device
            block_size_unknown = None  # filled at forward time (needs the cache's block size)
            rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
            token_idx = torch.tensor([qsl[i] for i in decode_rows], dtype=torch.long, device=device)
            lens = [seq_lens[i] for i in decode_rows]
            decode = (rows, token_idx, lens, block_size_unknown)
        prefills = [(i, qsl[i], qsl[i + 1], seq_lens[i]) for i in prefill_rows]
        self._plan_key, self._plan = metadata, (decode, prefills)
        return self._plan

    def forward(self, query, key, value, kv_cache, metadata, scale):
        num_tokens = metadata.num_actual_tokens
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, num_tokens)
        decode, prefills = self._make_plan(metadata)
        out = torch.empty_like(query)
        if num_tokens < query.shape[0]:
            out[num_tokens:].zero_()
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        block_size = key_cache.shape[1]
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        gqa = num_heads != num_kv_heads
        if decode is not None:
            rows, token_idx, lens, _ = decode
            max_len = max(lens)
            num_blocks = -(-max_len // block_size)
            # [B, num_blocks] -> [B, num_blocks * block_size, KVH, D]
            blocks = metadata.block_table[rows, :num_blocks].long()
            k = key_cache[blocks].flatten(1, 2)
            v = value_cache[blocks].flatten(1, 2)
            pos = torch.arange(num_blocks * block_size, device=query.device)
            lens_t = torch.tensor(lens, device=query.device)
            mask = (pos[None, :] < lens_t[:, None])[:, None, None, :]  # [B, 1, 1, L]
            q = query[token_idx].unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                               scale=scale, enable_gqa=gqa)
            out[token_idx] = o.squeeze(2)
        for row, start, end, seq_len in prefills:
            query_len = end - start
            num_blocks = -(-seq_len // block_size)
            blocks = metadata.block_table[row, :num_blocks].long()
            k = key_cache[blocks].flatten(0, 1)[:seq_len]  # [S, KVH, D]
            v = value_cache[blocks].flatten(0, 1)[:seq_len]
            q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            if seq_len == query_len:
                o = F.scaled_dot_product_attention(q, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                # Chunk after cached context: query j sees positions < seq_len - query_len + j + 1.
                offset = seq_len - query_len
                qpos = torch.arange(query_len, device=query.device)[:, None] + offset
                kpos = torch.arange(seq_len, device=query.device)[None, :]
                o = F.scaled_dot_product_attention(q, kh, vh, attn_mask=kpos <= qpos, scale=scale,
                                                   enable_gqa=gqa)
            out[start:end] = o.squeeze(0).transpose(0, 1)
        return out
