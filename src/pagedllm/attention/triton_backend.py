"""TritonAttentionBackend: paged KV-cache writes + paged attention with the Triton kernels.

forward() never synchronizes with the host: kernel grids depend only on tensor shapes and on
metadata host ints (num_reqs, max_query_len) that are fixed for a captured CUDA graph.

CUDA-graph contract for pure-decode batches (max_query_len == 1):
  * capture with num_reqs = the padded batch size (query row i is request i's token);
  * padded requests use seq_len 0 (their output rows are zeros and they read no cache) and any
    in-range block ids; padded tokens' slot_mapping points at a reserved scratch slot (see
    kernels/reshape_and_cache.py);
  * the split-KV workspace is allocated once per (device, heads, head_size) at its worst-case size,
    before capture if `reserve_workspace` is called, so replays reuse fixed addresses.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm import envs
from pagedllm.attention.backend import AttentionBackend, QKVSpec
from pagedllm.forward_context import AttentionMetadata
from pagedllm.kernels.paged_attention import (
    FEW_QUERY_MAX_LEN,
    DecodePrep,
    SHORT_CONTEXT_LEN,
    TINY_CONTEXT_LEN,
    decode_block_n,
    decode_num_splits,
    decode_workspace_numel,
    few_query_pad,
    few_query_workspace_numel,
    paged_decode_attention,
    paged_few_query_attention,
    paged_prefill_attention,
    prefill_block_m,
)
from pagedllm.kernels.qkv_prep import qkv_prep
from pagedllm.kernels.reshape_and_cache import reshape_and_cache


# Split launches start the longest contexts first from this many requests on: with many requests the long ones
# otherwise start last and set the launch's tail; with few there is no tail to shorten, and the extra dependent
# load of the order only adds latency (measurements: docs/benchmarks.md, GPU section).
ORDERED_SPLIT_MIN_REQS = 32


def decode_uses_order(num_reqs: int, num_splits: int) -> bool:
    """Whether a decode launch reads `decode_order`: always with one split per request (not every program fits on
    the GPU at once, so start order decides the tail), and for split launches of many requests."""
    return num_splits == 1 or num_reqs >= ORDERED_SPLIT_MIN_REQS


# Decode steps of up to this many requests let the attention kernel do qkv_prep's work (DecodePrep): one launch
# less pays where the step is launch-bound (1-4 rows); at 8-16 rows the two launches were a little faster, from 64
# on level (docs/benchmarks.md, "The decode prep by batch size").
DECODE_PREP_MAX_REQS = 4


def decode_prep_wanted(num_reqs: int) -> bool:
    """Whether a decode step of `num_reqs` requests uses DecodePrep (PAGEDLLM_DECODE_PREP: auto / 1 / 0)."""
    mode = envs.PAGEDLLM_DECODE_PREP
    return mode == "1" or (mode == "auto" and num_reqs <= DECODE_PREP_MAX_REQS)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_fp8_kv = True  # the kernels widen what they load to the query dtype and narrow what they store
    supports_mixed_graphs = True
    host_lens_may_be_bounds = True
    supports_logits_soft_cap = True

    def __init__(self, max_splits: Optional[int] = None) -> None:
        # Upper bound on split-KV partitions per (request, kv head); PAGEDLLM_DECODE_MAX_SPLITS tunes it.
        self.max_splits = max_splits or envs.PAGEDLLM_DECODE_MAX_SPLITS
        # Decode programs start with the longest contexts (see paged_decode_attention's `order`).
        self.wants_decode_order = envs.PAGEDLLM_DECODE_LPT
        # (device, num_kv_heads, num_heads, head_size) -> (part_out, part_lse), fp32, never freed:
        # captured graphs keep pointing at them.
        self._workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _workspace(self, key: tuple, numels, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 (part_out, part_lse) pair under `key`, allocated at the sizes numels() gives the first time
        (every layer of every step asks)."""
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = tuple(torch.empty(n, dtype=torch.float32, device=device) for n in numels())
        return ws

    def reserve_workspace(self, num_heads: int, num_kv_heads: int, head_size: int,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate (once) the worst-case split-KV workspace; call before CUDA-graph capture."""
        device = torch.device(device)
        return self._workspace((device, num_kv_heads, num_heads, head_size),
                               lambda: decode_workspace_numel(num_kv_heads, num_heads, head_size, device,
                                                              self.max_splits), device)

    def _few_query_workspace(self, num_heads: int, num_kv_heads: int, head_size: int,
                             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        return self._workspace(("few", device, num_kv_heads, num_heads, head_size),
                               lambda: few_query_workspace_numel(num_kv_heads, num_heads, head_size, device), device)

    def few_query_tile(self, num_heads: int, num_kv_heads: int, max_query_len: int) -> Optional[int]:
        """The mixed-graph tile id (negative: -query tokens per tile) of the few-query split-KV launch for steps
        whose requests have <= max_query_len query tokens each, or None where it does not apply."""
        if not envs.PAGEDLLM_FEW_QUERY_ATTENTION:
            return None
        q_pad = few_query_pad(max_query_len, num_heads, num_kv_heads)
        return None if q_pad is None else -q_pad

    def graph_seq_len_buckets(self, num_reqs: int, num_kv_heads: int, max_model_len: int,
                              device: torch.device) -> list[int]:
        """Upper bounds of max_seq_len to capture decode CUDA graphs for at this batch size (ascending; the last
        is max_model_len): one per distinct split-KV configuration."""
        def launch(max_seq_len: int) -> tuple[int, int]:
            splits = decode_num_splits(num_reqs, num_kv_heads, device, self.max_splits, max_seq_len)
            return splits, decode_block_n(torch.bfloat16, 128, splits, max_seq_len)

        bounds = [b for b in (TINY_CONTEXT_LEN, SHORT_CONTEXT_LEN) if b < max_model_len] + [max_model_len]
        # Keep a bound only where the launch differs from the next larger one.
        return [b for i, b in enumerate(bounds) if i == len(bounds) - 1 or launch(b) != launch(bounds[i + 1])]

    def warmup(self, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
               device: torch.device, max_query_len: int, cache_dtype: Optional[torch.dtype] = None,
               sliding_windows: tuple = (None,), soft_caps: tuple = (None,)) -> None:
        """Compile, at start-up, every variant of the prefill kernel that serving can hit (its tile size
        follows the step's longest query chunk; layers with a sliding window or a logits soft cap use variants of
        their own), so no request ever waits for Triton's compiler."""
        cache = torch.zeros(2, 2, block_size, num_kv_heads, head_size, dtype=cache_dtype or dtype, device=device)
        table = torch.zeros(1, 2, dtype=torch.int32, device=device)
        q_len = 1
        while True:
            tokens = min(q_len, 2 * block_size)
            query = torch.zeros(tokens, num_heads, head_size, dtype=dtype, device=device)
            # Neither the window's nor the cap's value is specialized on: one variant per (windowed, capped).
            for window, cap in {(w is not None, c is not None) for w in sliding_windows for c in soft_caps}:
                paged_prefill_attention(query, cache, table,
                                        torch.tensor([tokens], dtype=torch.int32, device=device),
                                        torch.tensor([0, tokens], dtype=torch.int32, device=device), 1.0,
                                        num_seqs=1, max_query_len=q_len, sliding_window=block_size if window else None,
                                        logits_soft_cap=50.0 if cap else None)
            if q_len >= max_query_len:
                break
            q_len = min(2 * q_len, max_query_len)

    def mixed_graph_tiles(self, dtype, num_heads, num_kv_heads, head_size):
        # The smallest tile (decode rows waste none of it) and the largest (long prefill chunks read each K/V
        # block once per tile, so fewer, taller tiles read less).
        gqa = num_heads // num_kv_heads
        return sorted({prefill_block_m(dtype, gqa, head_size, max_query_len=1),
                       prefill_block_m(dtype, gqa, head_size, max_query_len=None)})

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        scale: float,
        output: Optional[torch.Tensor] = None,  # [num_tokens, num_heads, head_size]
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
    ) -> torch.Tensor:
        if output is None:
            output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if query.shape[0] == 0 or metadata.num_reqs == 0:
            return output
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        return self._attend(query, kv_cache, metadata, scale, output, sliding_window, logits_soft_cap)

    def forward_qkv(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_size], the projection output
        positions: torch.Tensor,  # [num_tokens]
        cos_sin_cache: torch.Tensor,  # [max_position, head_size]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        spec: QKVSpec,
    ) -> Optional[torch.Tensor]:
        """Norm (optional) + rotary + KV write in one kernel, then attention. Returns the output
        [num_tokens, num_heads, head_size], or None when this case needs the unfused path (the caller runs it).
        Rotates q in place inside qkv."""
        if not envs.PAGEDLLM_FUSED_QKV or cos_sin_cache.shape[-1] != spec.head_size or qkv.stride(-1) != 1:
            return None
        if spec.q_norm_weight is not None and (
                spec.q_norm_weight.dtype != spec.k_norm_weight.dtype
                or spec.q_norm_weight.dtype not in (qkv.dtype, torch.float32)):
            return None  # (float32 weights: Gemma's (1 + w) norms, taken in float32 by the kernel)
        num_tokens = qkv.shape[0]
        output = torch.empty(num_tokens, spec.num_heads, spec.head_size, dtype=qkv.dtype, device=qkv.device)
        if num_tokens == 0 or metadata.num_reqs == 0:
            return output
        if (metadata.max_query_len == 1 and spec.kv_scales is None and kv_cache.dtype == qkv.dtype
                and decode_prep_wanted(metadata.num_reqs)):
            # A decode step: the attention kernel does qkv_prep's work itself (one launch less)
            # (as_strided: a view would give a one-row batch a packed row stride, hiding where K / V are)
            query = qkv.as_strided((num_tokens, spec.num_heads, spec.head_size), (qkv.stride(0), spec.head_size, 1))
            prep = DecodePrep(positions, cos_sin_cache, metadata.slot_mapping, spec.q_norm_weight, spec.k_norm_weight,
                              spec.eps)
            return self._attend(query, kv_cache, metadata, spec.scale, output, spec.sliding_window,
                                spec.logits_soft_cap, spec.output_shrink, prep=prep)
        query = qkv_prep(qkv, positions, cos_sin_cache, kv_cache, metadata.slot_mapping, spec.num_heads,
                         spec.num_kv_heads, spec.head_size, spec.q_norm_weight, spec.k_norm_weight, spec.eps,
                         kv_scales=spec.kv_scales)
        out_scale = spec.kv_scales[1:2] if spec.kv_scales is not None else None  # v_scale, in the kernels' store
        return self._attend(query, kv_cache, metadata, spec.scale, output, spec.sliding_window, spec.logits_soft_cap,
                            spec.output_shrink, out_scale)

    def _attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                output: torch.Tensor, sliding_window: Optional[int] = None,
                logits_soft_cap: Optional[float] = None, output_shrink=None,
                out_scale: Optional[torch.Tensor] = None, prep: Optional[DecodePrep] = None) -> torch.Tensor:
        """Attention over the cache, which already holds this step's K/V (the output times out_scale, if given;
        prep: a decode step whose kernel writes them, `query` then the unrotated q of the qkv rows)."""
        num_heads, head_size = query.shape[1], query.shape[2]
        num_kv_heads = kv_cache.shape[3]
        if metadata.max_query_len == 1:
            # A query sees at most its window: split and tile for that (host values, fixed in a captured graph).
            keys = metadata.max_seq_len if sliding_window is None else min(metadata.max_seq_len, sliding_window)
            num_splits = decode_num_splits(metadata.num_reqs, num_kv_heads, query.device, self.max_splits, keys,
                                           kv_cache.dtype)
            workspace = None
            if num_splits > 1:
                workspace = self.reserve_workspace(num_heads, num_kv_heads, head_size, query.device)
            paged_decode_attention(
                query, kv_cache, metadata.block_table, metadata.seq_lens, scale,
                num_seqs=metadata.num_reqs, output=output, workspace=workspace, num_splits=num_splits,
                block_n=decode_block_n(query.dtype, head_size, num_splits, keys, kv_cache.dtype),
                order=metadata.decode_order if decode_uses_order(metadata.num_reqs, num_splits) else None,
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, shrink=output_shrink,
                out_scale=out_scale, prep=prep)
        else:
            assert prep is None, "the decode prep is for one-token queries"
            tile = metadata.graph_prefill_tile
            if tile is None:  # eager: the few-query launch when every request has few query tokens
                tile = self.few_query_tile(num_heads, num_kv_heads, metadata.max_query_len)
            q_pad = None
            if tile is not None and tile < 0:
                q_pad = few_query_pad(-tile, num_heads, num_kv_heads)
                tile = None  # (a layer it does not fit: the prefill kernel's own tile)
            if q_pad is not None:
                # Splits as for decode rows, counting a request per FEW_QUERY_MAX_LEN tokens at least (the
                # workspace's bound; graph padding rows count as requests).
                reqs = max(metadata.num_reqs, -(-query.shape[0] // FEW_QUERY_MAX_LEN))
                num_splits = decode_num_splits(reqs, num_kv_heads, query.device, self.max_splits,
                                               metadata.max_seq_len, kv_cache.dtype)
                paged_few_query_attention(
                    query, kv_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc, scale,
                    num_seqs=metadata.num_reqs, q_pad=q_pad, output=output,
                    workspace=self._few_query_workspace(num_heads, num_kv_heads, head_size, query.device),
                    num_splits=num_splits,
                    block_n=decode_block_n(query.dtype, head_size, num_splits, metadata.max_seq_len, kv_cache.dtype),
                    sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, out_scale=out_scale)
            else:
                paged_prefill_attention(
                    query, kv_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc, scale,
                    num_seqs=metadata.num_reqs, max_query_len=metadata.max_query_len, output=output,
                    block_m=tile, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                    out_scale=out_scale)
        return output
