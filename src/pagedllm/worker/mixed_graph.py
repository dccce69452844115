"""Mixed prefill + decode steps as captured CUDA graphs, one per token-count bucket, sharing the decode graphs'
memory pool.

A mixed step's eager attention launch follows per-step host ints (number of requests, longest query chunk).
Captured, it follows shapes alone: the prefill kernel (which already finds each program's request by a binary
search over query_start_loc and lets programs past a request's tiles exit) is launched for `max_reqs` request
rows and the bucket's token count with a fixed query tile (`AttentionMetadata.graph_prefill_tile`). Rows past
the step's requests have no query tokens (their query_start_loc entries repeat the token count), so their
programs exit at once.

A step of n tokens is padded to the smallest bucket >= n: padding tokens carry token 0 at position 0, write
their K/V into the scratch block (as decode-graph padding does) and belong to no request, so attention never
reads them and no other row depends on them (every other op is row-wise or a GEMM over rows).
Static inputs are refreshed by device copies before each replay; the captured forward never syncs with the host.
The exact verify buckets of few tokens have a greedy tail (worker/greedy_tail.py): a batch-1 verify step's LM head
+ argmax, replayed after them.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import torch

from pagedllm import envs
from pagedllm.forward_context import AttentionMetadata, set_forward_context, with_kv_groups
from pagedllm.worker.greedy_tail import GreedyTails
from pagedllm.worker.static_inputs import copy_rows

logger = logging.getLogger("pagedllm")


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """Token buckets: fine steps for small counts (where padding would be a large part of the step), then at most
    25% padding; the last is `max_tokens`."""
    sizes = [16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    sizes += list(range(1280, 2049, 256)) + list(range(2560, 8193, 512))
    sizes = [s for s in sizes if s < max_tokens] + [max_tokens]
    return sorted(set(sizes))


def bucket_for(sizes: list[int], num_tokens: int) -> Optional[int]:
    """The smallest bucket >= num_tokens, or None when the step is larger than every bucket."""
    for size in sizes:
        if size >= num_tokens:
            return size
    return None


# A program's fixed cost (loading K/V tiles, its loop) in units of query rows, for `pick_tile`.
_TILE_OVERHEAD_ROWS = 32


def pick_tile(tiles: list[int], gqa_pad: int, query_lens: np.ndarray, seq_lens: np.ndarray) -> int:
    """The tile with the least estimated attention work for a step: each request runs ceil(q / (tile / gqa_pad))
    programs, each over about its context, costing (tile rows + a fixed overhead) per context position.
    A tall tile wastes most of its rows on a decode row; a short one re-reads the context per few query tokens."""
    best, best_cost = tiles[-1], None
    for tile in tiles:
        block_q = max(1, tile // gqa_pad)
        programs = -(-query_lens // block_q)
        cost = float(np.dot(programs, seq_lens)) * (tile + _TILE_OVERHEAD_ROWS)
        if best_cost is None or cost < best_cost:
            best, best_cost = tile, cost
    return best


class GraphInputs:
    """Static buffers for steps of up to `max_tokens` tokens and `max_reqs` requests (see the module docstring)."""

    def __init__(self, runner, max_tokens: int, max_reqs: int) -> None:
        dev = runner.device
        self.max_tokens, self.max_reqs = max(max_tokens, 1), max(max_reqs, 1)
        self.scratch_slot = runner.scratch_block * runner.block_size
        # Token ids, positions and slots as the rows of one buffer: a step's three arrays come in with one copy
        # where they were staged one after another (static_inputs.copy_rows).
        self.token_inputs = torch.zeros(3, self.max_tokens, dtype=torch.long, device=dev)
        self.input_ids, self.positions, self.slot_mapping = self.token_inputs.unbind(0)
        self.slot_mapping.fill_(self.scratch_slot)
        self.query_start_loc = torch.zeros(self.max_reqs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(self.max_reqs, dtype=torch.int32, device=dev)
        # One table and slot mapping per KV-cache group (core/kv_cache_groups.py); [0] is group 0's.
        self.block_tables = torch.full((runner.num_kv_groups, self.max_reqs, runner.max_blocks_per_req),
                                       runner.scratch_block, dtype=torch.int32, device=dev)
        self.block_table = self.block_tables[0]
        self.group_slot_mappings = torch.full((runner.num_kv_groups - 1, self.max_tokens), self.scratch_slot,
                                              dtype=torch.long, device=dev)
        # Per buffer, the (rows copied, rows padded to, fill) of the last load: a step laid out as the one before
        # (every verify step of a batch, say) finds its padding already in place and skips the fill launches.
        self._padding: dict[object, tuple[int, int, int]] = {}

    def forget_padding(self) -> None:
        """Something other than load() wrote the buffers (capture inputs): the next load fills its padding."""
        self._padding.clear()

    def _pad(self, key, static: torch.Tensor, values: torch.Tensor, size: int, fill: int) -> None:
        static[:values.shape[0]].copy_(values, non_blocking=True)
        self._fill(key, static, values.shape[0], size, fill)

    def _fill(self, key, static: torch.Tensor, n: int, size: int, fill: int) -> None:
        """static[n:size] = fill, skipped when the last load left it so."""
        layout = (n, size, fill)
        if size > n and self._padding.get(key) != layout:
            static[n:size].fill_(fill)
        self._padding[key] = layout

    def metadata(self, tokens: int, reqs: int, max_query_len: int, max_seq_len: int,
                 graph_prefill_tile=None) -> AttentionMetadata:
        """The metadata a graph is captured with: views of the static buffers."""
        md = AttentionMetadata(
            num_actual_tokens=tokens, num_reqs=reqs, max_query_len=max_query_len, max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[:reqs + 1], seq_lens=self.seq_lens[:reqs],
            block_table=self.block_table[:reqs], slot_mapping=self.slot_mapping[:tokens],
            graph_prefill_tile=graph_prefill_tile)
        return with_kv_groups(md, [t[:reqs] for t in self.block_tables[1:]],
                              [s[:tokens] for s in self.group_slot_mappings])

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, tokens: int,
             reqs: int) -> None:
        """A step's inputs into the buffers, padded to `tokens` tokens and `reqs` request rows."""
        n = input_ids.shape[0]
        copy_rows(self.token_inputs, (input_ids, positions, md.slot_mapping), n)
        self._fill("input_ids", self.input_ids, n, tokens, 0)
        self._fill("positions", self.positions, n, tokens, 0)
        self._fill("slot_mapping", self.slot_mapping, n, tokens, self.scratch_slot)
        self._pad("query_start_loc", self.query_start_loc, md.query_start_loc, reqs + 1, n)  # padding: no queries
        self._pad("seq_lens", self.seq_lens, md.seq_lens, reqs, 0)
        nb = md.block_table.shape[1]
        self.block_table[:md.num_reqs, :nb].copy_(md.block_table, non_blocking=True)
        for g in range(1, len(self.block_tables)):
            group = md.for_group(g)
            self._pad(("group_slots", g), self.group_slot_mappings[g - 1], group.slot_mapping, tokens,
                      self.scratch_slot)
            self.block_tables[g, :md.num_reqs, :nb].copy_(group.block_table, non_blocking=True)


class MixedGraphRunner:
    """Capture and replay of mixed steps in token buckets (see the module docstring)."""

    def __init__(self, runner, pool=None, extra_sizes=(), few_query_len: Optional[int] = None) -> None:
        self.runner = runner
        self.device = runner.device
        # No step holds more than max_num_seqs full-length requests; larger buckets could not even be filled
        # with valid capture inputs.
        max_tokens = min(runner.max_num_batched_tokens, envs.PAGEDLLM_MIXED_GRAPH_MAX_TOKENS,
                         runner.max_num_seqs * runner.max_model_len)
        # compilation_config's capture sizes (in tokens, as vLLM's), else pagedllm's up to its max capture size; a
        # mixed step has >= 2 tokens
        settings = runner.graph_settings
        chosen = settings.chosen_sizes(max_tokens, smallest=2)
        max_tokens = max(chosen, default=0) if chosen is not None else settings.limit(max_tokens)
        self.sizes = chosen if chosen is not None else mixed_capture_sizes(max_tokens) if max_tokens >= 2 else []
        # Extra exact buckets (speculative verify steps: k + 1 tokens per request) so they replay unpadded.
        self.sizes = sorted(set(self.sizes) | {s for s in extra_sizes if 2 <= s <= max_tokens})
        self.max_size = self.sizes[-1] if self.sizes else 0
        first = runner.model.attn_layers[0]
        self.gqa_pad = 1 << max(0, first.num_heads // first.num_kv_heads - 1).bit_length()
        self.tiles = runner.attn_backend.mixed_graph_tiles(runner.dtype, first.num_heads, first.num_kv_heads,
                                                           first.head_size)
        if envs.PAGEDLLM_MIXED_GRAPH_TILE:  # one fixed tile (A/B benchmarks)
            self.tiles = [envs.PAGEDLLM_MIXED_GRAPH_TILE]
        # Steps whose requests have <= few_query_len query tokens each (verify steps of k + 1 tokens) also get a
        # graph with the backend's few-query attention launch (a negative tile id), for the buckets up to the
        # largest exact verify bucket.
        self.few_tile, self.few_max_size = None, 0
        if few_query_len and extra_sizes:
            self.few_tile = runner.attn_backend.few_query_tile(first.num_heads, first.num_kv_heads, few_query_len)
            self.few_max_size = max(extra_sizes) if self.few_tile is not None else 0
        self.inputs: Optional[GraphInputs] = None  # the static inputs, allocated at capture
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (token bucket, tile, with LoRA) -> graph
        self.outputs: dict[tuple, torch.Tensor] = {}
        # With enable_lora, each bucket and tile also has a graph with the LoRA kernels (see cuda_graph.py).
        self.lora_state = runner.lora.state if getattr(runner, "lora", None) is not None else None
        self.lora_variants = (False, True) if self.lora_state is not None else (False,)
        self.pool = pool
        self.num_replays = 0  # steps served by a graph (tests and benchmarks read it)
        # Verify steps whose rows are all the step's tokens (speculation at batch 1, 2, ...) sample every row.
        self.tail_sizes = set(extra_sizes)
        self.tails = GreedyTails(runner)
        self.last_key: Optional[tuple] = None

    def _metadata(self, size: int, tile: int) -> AttentionMetadata:
        reqs = min(self.runner.max_num_seqs, size)  # every request of a step has at least one token
        return self.inputs.metadata(size, reqs, size, self.runner.max_model_len, graph_prefill_tile=tile)

    def _fill_capture_inputs(self, size: int) -> None:
        """Requests of at most max_model_len tokens covering the bucket, every K/V write into the scratch slot
        and every block-table entry naming the scratch block: real kernels, harmless writes."""
        self.inputs.forget_padding()
        chunk = min(size, self.runner.max_model_len)
        starts = list(range(0, size, chunk)) + [size]
        reqs = min(self.runner.max_num_seqs, size)
        starts += [size] * (reqs + 1 - len(starts))
        self.inputs.query_start_loc[:reqs + 1].copy_(torch.tensor(starts, dtype=torch.int32))
        self.inputs.seq_lens[:reqs].copy_(torch.tensor([b - a for a, b in zip(starts, starts[1:])],
                                                       dtype=torch.int32))

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.sizes:
            return
        if self.inputs is None:
            self.inputs = GraphInputs(self.runner, self.max_size, self.runner.max_num_seqs)
        start = time.perf_counter()
        model = self.runner.model
        backend = self.runner.attn_backend
        for size in reversed(self.sizes):  # largest first so smaller buckets reuse its pool memory
            self._fill_capture_inputs(size)
            for tile in self.tiles + ([self.few_tile] if size <= self.few_max_size else []):
                for with_lora in self.lora_variants:
                    if self.lora_state is not None:
                        self.lora_state.clear()  # no adapter tokens while capturing: the LoRA kernels exit at once
                        self.lora_state.active = with_lora
                    md = self._metadata(size, tile)
                    with set_forward_context(md, backend):
                        backend.prepare(md)
                        ids, pos = self.inputs.input_ids[:size], self.inputs.positions[:size]
                        model(ids, pos)  # warm-up: compile outside the capture
                        torch.cuda.synchronize(self.device)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=self.pool):
                            out = model(ids, pos)
                    if self.pool is None:
                        self.pool = graph.pool()
                    self.graphs[(size, tile, with_lora)] = graph
                    self.outputs[(size, tile, with_lora)] = out
                    if size in self.tail_sizes:
                        self.tails.capture((size, tile, with_lora), out, self.pool)
        if self.lora_state is not None:
            self.lora_state.clear()
        torch.cuda.synchronize(self.device)
        tails = f" (and {len(self.tails.graphs)} of greedy LM head + argmax)" if self.tails.graphs else ""
        logger.info("Captured %d CUDA graphs for mixed steps of %d..%d tokens (query tiles %s)%s in %.1f s.",
                    len(self.graphs), self.sizes[0], self.sizes[-1], self.tiles, tails, time.perf_counter() - start)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            md: AttentionMetadata) -> Optional[torch.Tensor]:
        n = input_ids.shape[0]
        size = bucket_for(self.sizes, n)
        if size is None or md.num_reqs > self.runner.max_num_seqs:
            return None
        # Rows past the step's requests: no query tokens (start = end = n), so their programs exit at once.
        self.inputs.load(input_ids, positions, md, size, min(self.runner.max_num_seqs, size))
        tile = self.tiles[0]
        if size <= self.few_max_size and md.max_query_len <= -self.few_tile:
            tile = self.few_tile
        elif len(self.tiles) > 1:
            qsl = np.asarray(md.query_start_loc_cpu)
            tile = pick_tile(self.tiles, self.gqa_pad, np.diff(qsl), np.asarray(md.seq_lens_cpu))
        self.runner.attn_backend.prepare(md)
        key = (size, tile, self.lora_state is not None and self.lora_state.active)
        self.graphs[key].replay()
        self.num_replays += 1
        self.last_key = key
        return self.outputs[key][:n]

    def greedy(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Argmax token ids of the last replay's output rows `hidden` from its greedy tail (None: no tail)."""
        return self.tails.replay(self.last_key, hidden)
