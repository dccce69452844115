"""Pure-PyTorch paged attention: the CPU path and the reference every GPU kernel is checked against.

One call handles a batch that mixes decodes (query_len == 1), prefill chunks and prefix-cache hits:
  * all decode rows are done together: their blocks are gathered into one padded [B, L] context and
    attended with a length mask (one gather + one SDPA per layer, however many requests);
  * each prefill row gathers its own context and attends causally with the chunk's offset.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.soft_cap import sdpa_for
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


def effective_window(window: Optional[int], seq_len: int) -> Optional[int]:
    """The window when it can hide a key of a context of seq_len tokens, else None (plain causal)."""
    return window if window is not None and window < seq_len else None


def window_key_start(seq_len: int, query_len: int, window: Optional[int]) -> int:
    """The first context position any query of a chunk (the last query_len of seq_len tokens) sees: with a
    sliding window, the first query (at seq_len - query_len) sees keys after seq_len - query_len - window."""
    return 0 if window is None else max(0, seq_len - query_len - window + 1)


def chunk_mask(query_len: int, seq_len: int, device: torch.device, window: Optional[int] = None,
               key_start: int = 0) -> Optional[torch.Tensor]:
    """[Q, S - key_start] bool mask for a chunk that follows seq_len - query_len cached tokens, over the context
    positions key_start..seq_len-1: query j (at q = seq_len - query_len + j) sees positions k <= q, and with a
    sliding window only k > q - window. None for a fresh prompt without a window, which is plain causal."""
    if seq_len == query_len and window is None and key_start == 0:
        return None
    qpos = torch.arange(query_len, device=device)[:, None] + (seq_len - query_len)
    kpos = torch.arange(key_start, seq_len, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
                    scale: float, logits_soft_cap: Optional[float] = None) -> torch.Tensor:
    """One request's query chunk [Q, H, D] over its whole context key/value [1, KVH, S, D] with torch's SDPA
    (`mask` from chunk_mask; soft-capped logits with a cap: attention/soft_cap.py); returns [Q, H, D]."""
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    o = sdpa_for(logits_soft_cap)(q, key, value, attn_mask=mask, is_causal=mask is None, scale=scale,
                                  enable_gqa=q.shape[1] != key.shape[1])
    return o.squeeze(0).transpose(0, 1)


class _StepPlan:
    """Everything about the batch layout that all layers share, computed once per step (per attention window:
    layers with different sliding windows read different spans of the same block tables)."""

    def __init__(self, metadata: AttentionMetadata, block_size: int) -> None:
        qsl = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        if qsl is None or seq_lens is None:
            qsl = metadata.query_start_loc.tolist()
            seq_lens = metadata.seq_lens.tolist()
        self.qsl, self.seq_lens, self.block_size = qsl, seq_lens, block_size
        self.block_table = metadata.block_table
        self.num_reqs = metadata.num_reqs
        self._layouts: dict[Optional[int], tuple] = {}

    def layout(self, window: Optional[int]) -> tuple:
        """(decode, prefills) for layers with this sliding window (None: full attention)."""
        found = self._layouts.get(window)
        if found is None:
            found = self._layouts[window] = (self._decode(window), self._prefills(window))
        return found

    def _decode(self, window: Optional[int]):
        qsl, seq_lens, block_size = self.qsl, self.seq_lens, self.block_size
        device = self.block_table.device
        decode_rows = [i for i in range(self.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        if not decode_rows:
            return None
        lens = [seq_lens[i] for i in decode_rows]
        window = effective_window(window, max(lens))
        rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        token_idx = torch.tensor([qsl[i] for i in decode_rows], dtype=torch.long, device=device)
        lens_t = torch.tensor(lens, device=device)
        if window is None:
            num_blocks = -(-max(lens) // block_size)
            blocks = self.block_table[rows, :num_blocks].long()  # [B, num_blocks]
            pos = torch.arange(num_blocks * block_size, device=device)[None, :]
            valid = pos < lens_t[:, None]
        else:
            # Each row gathers only the blocks of its window: the keys after seq_len - 1 - window. Blocks before
            # it may have been freed (their table entries are stale).
            first = [max(0, n - window) for n in lens]
            first_block = torch.tensor([f // block_size for f in first], device=device)
            num_blocks = max(-(-n // block_size) - f // block_size for n, f in zip(lens, first))
            idx = first_block[:, None] + torch.arange(num_blocks, device=device)[None, :]
            blocks = self.block_table[rows[:, None], idx.clamp(max=self.block_table.shape[1] - 1)].long()
            pos = (first_block[:, None] * block_size + torch.arange(num_blocks * block_size, device=device)[None, :])
            valid = (pos < lens_t[:, None]) & (pos >= torch.tensor(first, device=device)[:, None])
        # An additive float mask is faster than a boolean one in CPU SDPA (docs/benchmarks.md). It is built
        # in the model's dtype lazily (the first layer tells it).
        mask = valid[:, None, None, :]  # [B, 1, 1, L]
        contiguous = token_idx.numel() == qsl[-1] and decode_rows == list(range(len(decode_rows)))
        return [token_idx, blocks, mask, contiguous]

    def _prefills(self, window: Optional[int]) -> list:
        qsl, seq_lens, block_size = self.qsl, self.seq_lens, self.block_size
        device = self.block_table.device
        prefills = []
        for i in range(self.num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            query_len = end - start
            if query_len == 1:
                continue
            w = effective_window(window, seq_len)
            key_start = window_key_start(seq_len, query_len, w)
            first_block = key_start // block_size
            blocks = self.block_table[i, first_block:-(-seq_len // block_size)].long()
            # keys key_start..seq_len-1 sit at [skip, skip + seq_len - key_start) of the gathered blocks
            skip = key_start - first_block * block_size
            prefills.append((start, end, skip, seq_len - key_start, blocks,
                             chunk_mask(query_len, seq_len, device, w, key_start)))
        return prefills


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_fp8_kv = True
    supports_logits_soft_cap = True

    def __init__(self) -> None:
        # metadata id -> (metadata, plan): the step's metadata and its KV groups' (attention/backend.py); the
        # metadata is kept so its id is not reused while cached.
        self._plans: dict[int, tuple[AttentionMetadata, _StepPlan]] = {}

    def prepare(self, metadata: AttentionMetadata) -> None:
        self._plans.clear()

    def _plan_for(self, metadata: AttentionMetadata, block_size: int) -> _StepPlan:
        found = self._plans.get(id(metadata))
        if found is None or found[0] is not metadata:
            if len(self._plans) >= 16:  # callers that never call prepare (tests): keep the cache small
                self._plans.clear()
            found = self._plans[id(metadata)] = (metadata, _StepPlan(metadata, block_size))
        return found[1]

    def forward(self, query, key, value, kv_cache, metadata, scale, sliding_window=None, logits_soft_cap=None):
        num_tokens = metadata.num_actual_tokens
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, num_tokens)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        decode, prefills = self._plan_for(metadata, key_cache.shape[1]).layout(sliding_window)
        out = torch.empty_like(query)
        if num_tokens < query.shape[0]:
            out[num_tokens:].zero_()
        if decode is not None:
            token_idx, blocks, mask, contiguous = decode
            if mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
                decode[2] = mask
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
            o = sdpa_for(logits_soft_cap)(q, k, v, attn_mask=mask, scale=scale).reshape(b, num_heads, head_size)
            if contiguous and o.shape[0] == query.shape[0]:
                return o  # a pure-decode batch: no scatter needed
            out[token_idx] = o
        for start, end, skip, num_keys, blocks, mask in prefills:
            k = gather_blocks(key_cache, blocks, query.dtype).flatten(0, 1)[skip:skip + num_keys]
            v = gather_blocks(value_cache, blocks, query.dtype).flatten(0, 1)[skip:skip + num_keys]
            out[start:end] = chunk_attention(query[start:end], k.transpose(0, 1).unsqueeze(0),
                                             v.transpose(0, 1).unsqueeze(0), mask, scale, logits_soft_cap)
        return out
