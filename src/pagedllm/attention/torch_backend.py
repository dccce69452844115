"""Pure-PyTorch paged attention: the CPU path and the reference every GPU kernel is checked against.

One call handles a batch that mixes decodes (query_len == 1), prefill chunks and prefix-cache hits:
  * all decode rows are done together: their blocks are gathered into one padded [B, L] context and
    attended with a length mask (one gather + one SDPA per layer, however many requests);
  * each prefill row gathers its own context and attends causally with the chunk's offset.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend
from pagedllm.forward_context import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, num_tokens: int) -> None:
    """Scatter this step's K/V ([T, KVH, D]) into their slots of the paged cache (an FP8 cache stores them cast
    to E4M3, saturating; the Attention layer has already divided them by its per-layer scales)."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    slots = slot_mapping[:num_tokens]
    key, value = key[:num_tokens], value[:num_tokens]
    if kv_cache.dtype in FP8_KV_DTYPES:  # index_copy_ has no fp8 kernels: move the bytes
        # Saturate as the GPU kernels' conversion does: torch's cast turns |x| >= 480 into NaN.
        fmax = torch.finfo(kv_cache.dtype).max
        flat = flat.view(torch.uint8)
        key = key.clamp(-fmax, fmax).to(kv_cache.dtype).view(torch.uint8)
        value = value.clamp(-fmax, fmax).to(kv_cache.dtype).view(torch.uint8)
    flat[0].index_copy_(0, slots, key)
    flat[1].index_copy_(0, slots, value)


FP8_KV_DTYPES = (torch.float8_e4m3fn,)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[blocks] ([n, block_size, KVH, D]) in `dtype` (index_select, not cache[blocks]: advanced indexing is
    much slower on CPU, docs/benchmarks.md; an FP8 cache is gathered as bytes and widened)."""
    if cache.dtype in FP8_KV_DTYPES:
        return cache.view(torch.uint8).index_select(0, blocks).view(cache.dtype).to(dtype)
    return cache.index_select(0, blocks)


def chunk_mask(query_len: int, seq_len: int, device: torch.device) -> Optional[torch.Tensor]:
    """[Q, S] bool mask for a chunk that follows seq_len - query_len cached tokens (query j sees positions
    <= seq_len - query_len + j); None for a fresh prompt, which is plain causal."""
    if seq_len == query_len:
        return None
    qpos = torch.arange(query_len, device=device)[:, None] + (seq_len - query_len)
    return torch.arange(seq_len, device=device)[None, :] <= qpos


def chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
                    scale: float) -> torch.Tensor:
    """One request's query chunk [Q, H, D] over its whole context key/value [1, KVH, S, D] with torch's SDPA
    (`mask` from chunk_mask); returns [Q, H, D]."""
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    o = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, is_causal=mask is None, scale=scale,
                                       enable_gqa=q.shape[1] != key.shape[1])
    return o.squeeze(0).transpose(0, 1)


class _StepPlan:
    """Everything about the batch layout that all layers share, computed once per step."""

    def __init__(self, metadata: AttentionMetadata, block_size: int) -> None:
        qsl = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        if qsl is None or seq_lens is None:
            qsl = metadata.query_start_loc.tolist()
            seq_lens = metadata.seq_lens.tolist()
        device = metadata.block_table.device
        decode_rows = [i for i in range(metadata.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        self.decode = None
        if decode_rows:
            lens = [seq_lens[i] for i in decode_rows]
            num_blocks = -(-max(lens) // block_size)
            rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
            token_idx = torch.tensor([qsl[i] for i in decode_rows], dtype=torch.long, device=device)
            blocks = metadata.block_table[rows, :num_blocks].long()  # [B, num_blocks]
            pos = torch.arange(num_blocks * block_size, device=device)
            valid = (pos[None, :] < torch.tensor(lens, device=device)[:, None])[:, None, None, :]  # [B,1,1,L]
            # An additive float mask is faster than a boolean one in CPU SDPA (docs/benchmarks.md). It is built
            # in the model's dtype lazily (the first layer tells it).
            mask = valid
            contiguous = token_idx.numel() == qsl[-1] and decode_rows == list(range(len(decode_rows)))
            self.decode = (token_idx, blocks, mask, contiguous)
        self.prefills = []
        for i in range(metadata.num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            query_len = end - start
            if query_len == 1:
                continue
            blocks = metadata.block_table[i, :-(-seq_len // block_size)].long()
            self.prefills.append((start, end, seq_len, blocks, chunk_mask(query_len, seq_len, device)))


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_fp8_kv = True

    def __init__(self) -> None:
        self._plan_key = None
        self._plan = None

    def forward(self, query, key, value, kv_cache, metadata, scale):
        num_tokens = metadata.num_actual_tokens
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, num_tokens)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if self._plan_key is not metadata:
            self._plan_key, self._plan = metadata, _StepPlan(metadata, key_cache.shape[1])
        plan = self._plan
        out = torch.empty_like(query)
        if num_tokens < query.shape[0]:
            out[num_tokens:].zero_()
        if plan.decode is not None:
            token_idx, blocks, mask, contiguous = plan.decode
            if mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
                plan.decode = (token_idx, blocks, mask, contiguous)
            # [B, num_blocks, block_size, KVH, D] -> [B, KVH, L, D]
            shape = (*blocks.shape, *key_cache.shape[1:])
            flat = blocks.reshape(-1)
            k = gather_blocks(key_cache, flat, query.dtype).view(shape).flatten(1, 2).transpose(1, 2)
            v = gather_blocks(value_cache, flat, query.dtype).view(shape).flatten(1, 2).transpose(1, 2)
            # One query token per row: the query heads sharing a kv head act as that head's query rows
            # ([B, KVH, group, D]), so no GQA expansion of K/V is needed.
            q = query if contiguous else query[token_idx]
            b, num_heads, head_size = q.shape
            q = q.view(b, k.shape[1], num_heads // k.shape[1], head_size)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).reshape(b, num_heads, head_size)
            if contiguous and o.shape[0] == query.shape[0]:
                return o  # a pure-decode batch: no scatter needed
            out[token_idx] = o
        for start, end, seq_len, blocks, mask in plan.prefills:
            k = gather_blocks(key_cache, blocks, query.dtype).flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0)
            v = gather_blocks(value_cache, blocks, query.dtype).flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0)
            out[start:end] = chunk_attention(query[start:end], k, v, mask, scale)
        return out
