"""Decode steps as captured CUDA graphs, one per batch-size bucket, all sharing one memory pool.

A pure-decode batch of n requests is padded to the smallest bucket >= n. Padding rows are harmless real work:
token 0 at position 0, writing its K/V into the reserved scratch block (the last block of the pool, which
the scheduler never hands out) and attending over that one slot. Static input buffers are refreshed by
device copies before each replay; nothing in the captured forward may sync with the host. Graphs of few rows
have a greedy tail (worker/greedy_tail.py): the LM head + argmax of all-greedy steps, replayed after them; and, at
first use, sampled tails (the LM head + the device sampler of steps with temperature / top-p / min-p).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from pagedllm.forward_context import AttentionMetadata, set_forward_context, with_kv_groups
from pagedllm.worker.greedy_tail import GreedyTails, SampleTails
from pagedllm.worker.static_inputs import copy_rows

logger = logging.getLogger("pagedllm")


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 256, 16)) + list(range(256, 1025, 64))
    sizes = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
    return sorted(set(sizes))


class CudaGraphRunner:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.device = runner.device
        # compilation_config's capture sizes, else pagedllm's up to max_num_seqs (or its max capture size)
        settings = runner.graph_settings
        chosen = settings.chosen_sizes(runner.max_num_seqs)
        self.sizes = chosen if chosen is not None else capture_sizes(settings.limit(runner.max_num_seqs))
        self.max_size = self.sizes[-1] if self.sizes else 0
        self.scratch_block = runner.scratch_block
        bs = runner.block_size
        dev = self.device
        n = self.max_size
        # Token ids, positions and slots as the rows of one buffer: the step's three arrays, staged one after the
        # other at one stride (worker/host_stager.py), come in with a single copy (static_inputs.copy_rows).
        self.token_inputs = torch.zeros(3, n, dtype=torch.long, device=dev)
        self.input_ids, self.positions, self.slot_mapping = self.token_inputs.unbind(0)
        self.slot_mapping.fill_(self.scratch_block * bs)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # Rows longest context first, for backends that want it (padding rows, one token each, go last).
        self.with_order = runner.attn_backend.wants_decode_order
        self.rows = torch.arange(n, dtype=torch.int32, device=dev)
        self.decode_order = self.rows.clone()
        # One table per KV-cache group (sliding windows: core/kv_cache_groups.py); [0] is group 0's.
        self.block_tables = torch.full((runner.num_kv_groups, n, runner.max_blocks_per_req), self.scratch_block,
                                       dtype=torch.int32, device=dev)
        self.block_table = self.block_tables[0]
        self.group_slot_mappings = torch.full((runner.num_kv_groups - 1, n), self.scratch_block * bs,
                                              dtype=torch.long, device=dev)
        # Per batch size, the max_seq_len buckets with a graph each (see AttentionBackend.graph_seq_len_buckets).
        self.seq_len_buckets: dict[int, list[int]] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (size, seq-len bucket, with LoRA) -> graph
        self.outputs: dict[tuple, torch.Tensor] = {}
        # With enable_lora each shape has two graphs: with the LoRA kernels (their token -> slot map lives in the
        # LoRABatchState's persistent buffers) and without, for steps where no request uses an adapter.
        self.lora_state = runner.lora.state if getattr(runner, "lora", None) is not None else None
        self.lora_variants = (False, True) if self.lora_state is not None else (False,)
        self.pool = None
        # Rows >= this hold padding values (every buffer's padding row: token 0, position 0, the scratch slot and
        # block, length 1, its own index in the order); rows below it may hold a step's data. A run resets only
        # the rows between its batch and this, so a batch size padded the same way step after step fills nothing.
        self.clean_from = 0
        self.tails = GreedyTails(runner)
        self.sample_tails = SampleTails(runner, self.tails.max_rows)
        self.last_key: Optional[tuple] = None  # the graph the last run() replayed

    def _metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        md = AttentionMetadata(
            num_actual_tokens=size, num_reqs=size, max_query_len=1, max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size], slot_mapping=self.slot_mapping[:size],
            decode_order=self.decode_order[:size] if self.with_order else None)
        return with_kv_groups(md, [t[:size] for t in self.block_tables[1:]],
                              [s[:size] for s in self.group_slot_mappings])

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        backend = self.runner.attn_backend
        num_kv_heads = self.runner.kv_cache_spec().num_kv_heads
        for size in reversed(self.sizes):  # largest first so smaller graphs reuse its pool
            buckets = backend.graph_seq_len_buckets(size, num_kv_heads, self.runner.max_model_len, self.device)
            self.seq_len_buckets[size] = buckets
            for bucket in reversed(buckets):
                for with_lora in self.lora_variants:
                    self._capture_one(size, bucket, with_lora)
        torch.cuda.synchronize(self.device)
        tails = f" (and {len(self.tails.graphs)} of greedy LM head + argmax)" if self.tails.graphs else ""
        logger.info("Captured %d CUDA graphs for decode batch sizes %s..%s%s in %.1f s.", len(self.graphs),
                    self.sizes[0], self.sizes[-1], tails, time.perf_counter() - start)

    def _capture_one(self, size: int, bucket: int, with_lora: bool) -> None:
        model = self.runner.model
        backend = self.runner.attn_backend
        if self.lora_state is not None:
            self.lora_state.clear()  # no token has an adapter while capturing: the LoRA kernels exit at once
            self.lora_state.active = with_lora
        md = self._metadata(size, bucket)
        with set_forward_context(md, backend):
            backend.prepare(md)
            for _ in range(2):  # warm-up: Triton autotune / compile outside the capture
                model(self.input_ids[:size], self.positions[:size])
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = model(self.input_ids[:size], self.positions[:size])
        if self.lora_state is not None:
            self.lora_state.clear()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(size, bucket, with_lora)] = graph
        self.outputs[(size, bucket, with_lora)] = out
        self.tails.capture((size, bucket, with_lora), out, self.pool)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            md: AttentionMetadata) -> Optional[torch.Tensor]:
        n = md.num_reqs
        if n > self.max_size:
            return None
        size = next(s for s in self.sizes if s >= n)
        nb = md.block_table.shape[1]
        copy_rows(self.token_inputs, (input_ids, positions, md.slot_mapping), n)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        for g in range(1, len(self.block_tables)):
            group = md.for_group(g)
            self.block_tables[g, :n, :nb].copy_(group.block_table, non_blocking=True)
            self.group_slot_mappings[g - 1, :n].copy_(group.slot_mapping, non_blocking=True)
        self.block_table[:n, :nb].copy_(md.block_table, non_blocking=True)
        if self.with_order:  # (batch order when the caller gave none)
            self.decode_order[:n].copy_(self.rows[:n] if md.decode_order is None else md.decode_order,
                                        non_blocking=True)
        end = min(size, self.clean_from)
        if end > n:  # reset the padding rows that a larger batch dirtied
            self.input_ids[n:end].zero_()
            self.positions[n:end].zero_()
            self.slot_mapping[n:end].fill_(self.scratch_block * self.runner.block_size)
            self.seq_lens[n:end].fill_(1)
            self.block_tables[:, n:end, 0].fill_(self.scratch_block)
            self.group_slot_mappings[:, n:end].fill_(self.scratch_block * self.runner.block_size)
            if self.with_order:
                self.decode_order[n:end].copy_(self.rows[n:end])
        # rows [n, size) are padding now; rows past size keep what they held
        self.clean_from = n if self.clean_from <= size else max(self.clean_from, n)
        bucket = next(b for b in self.seq_len_buckets[size] if b >= md.max_seq_len)
        key = (size, bucket, self.lora_state is not None and self.lora_state.active)
        self.graphs[key].replay()
        self.last_key = key
        return self.outputs[key][:n]

    def greedy(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Argmax token ids of the last replay's output rows `hidden` from its greedy tail (None: no tail)."""
        return self.tails.replay(self.last_key, hidden)

    def sample(self, hidden: torch.Tensor, meta, floats: Optional[torch.Tensor], names) -> Optional[torch.Tensor]:
        """Sampled token ids of the last replay's output rows `hidden` from its sampled tail (None: none applies)."""
        if floats is None or self.last_key is None:
            return None
        return self.sample_tails.replay(self.last_key, hidden, self.outputs[self.last_key], meta, floats, names,
                                        self.pool)
