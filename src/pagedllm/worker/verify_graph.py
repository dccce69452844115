"""Speculative verify steps as captured CUDA graphs: up to k + 1 query tokens per request, one graph per
(batch-size bucket, context bucket), sharing the decode graphs' memory pool.

A verify step of r requests (each 1 + its drafts tokens, at most k + 1) is padded to the smallest batch bucket
b >= r and to b * (k + 1) tokens. The captured forward is the decode step's, with k + 1 rows per request: the
linear layers see b * (k + 1) rows (the few-row GEMV / skinny-GEMM kernels at small b) and attention runs the
split-KV verify kernel (kernels/verify_attention.py) with the decode split count of batch b, so the launch
depends on (b, context bucket) only, as for decode graphs (AttentionBackend.graph_seq_len_buckets).

Padding is harmless real work, as in worker/cuda_graph.py and worker/mixed_graph.py: padding tokens (after the
last request's) carry token 0 at position 0 and write their K/V into the scratch block; request rows past the
step's have no query tokens (query_start_loc repeats the token count) and seq_len 0, so their programs exit.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from pagedllm import envs
from pagedllm.forward_context import AttentionMetadata, set_forward_context
from pagedllm.worker.cuda_graph import capture_sizes
from pagedllm.worker.mixed_graph import pad_rows

logger = logging.getLogger("pagedllm")


def verify_capture_sizes(max_num_seqs: int, max_reqs: int) -> list[int]:
    """Batch buckets of verify graphs: the decode buckets up to max_reqs (speculation's batch limit)."""
    limit = min(max_num_seqs, max_reqs)
    return sorted({s for s in capture_sizes(max_num_seqs) if s < limit} | {limit}) if limit >= 1 else []


def build_verify_graphs(runner) -> Optional["VerifyGraphRunner"]:
    """The runner's verify graphs when speculation is configured on a backend with graph-safe mixed launches,
    or None (steps then take the mixed-step graphs or run eagerly)."""
    spec = runner.spec
    if spec is None or not runner.attn_backend.supports_mixed_graphs:
        return None
    limit = spec.config.disable_by_batch_size or runner.max_num_seqs
    max_reqs = min(limit, envs.PAGEDLLM_VERIFY_GRAPH_MAX_REQS, runner.max_num_seqs)
    if max_reqs < 1 or spec.config.num_speculative_tokens + 1 > runner.max_model_len:
        return None
    return VerifyGraphRunner(runner, spec.config.num_speculative_tokens + 1, max_reqs)


class VerifyGraphRunner:
    """Capture and replay of verify steps (see the module docstring)."""

    def __init__(self, runner, query_len: int, max_reqs: int, pool=None) -> None:
        self.runner = runner
        self.device = runner.device
        self.query_len = query_len  # k + 1: the most query tokens of one request in a verify step
        self.sizes = verify_capture_sizes(runner.max_num_seqs, max_reqs)
        self.max_size = self.sizes[-1]
        self.scratch_block = runner.scratch_block
        self.scratch_slot = runner.scratch_block * runner.block_size
        n, reqs, dev = self.max_size * query_len, self.max_size, self.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self.query_start_loc = torch.zeros(reqs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(reqs, dtype=torch.int32, device=dev)
        self.block_table = torch.full((reqs, runner.max_blocks_per_req), self.scratch_block, dtype=torch.int32,
                                      device=dev)
        self.seq_len_buckets: dict[int, list[int]] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (batch bucket, context bucket, with LoRA) -> graph
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.lora_state = runner.lora.state if getattr(runner, "lora", None) is not None else None
        self.lora_variants = (False, True) if self.lora_state is not None else (False,)
        self.pool = pool
        self.num_replays = 0  # steps served by a graph (tests and benchmarks read it)

    def _metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        tokens = size * self.query_len
        return AttentionMetadata(
            num_actual_tokens=tokens, num_reqs=size, max_query_len=self.query_len, max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size], slot_mapping=self.slot_mapping[:tokens])

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        backend = self.runner.attn_backend
        num_kv_heads = self.runner.kv_cache_spec().num_kv_heads
        for size in reversed(self.sizes):  # largest first so smaller graphs reuse its pool memory
            # Capture inputs: every request has k + 1 tokens in the scratch block.
            self.query_start_loc[:size + 1].copy_(torch.arange(size + 1, dtype=torch.int32) * self.query_len)
            self.seq_lens[:size].fill_(self.query_len)
            buckets = backend.graph_seq_len_buckets(size, num_kv_heads, self.runner.max_model_len, self.device)
            self.seq_len_buckets[size] = buckets
            for bucket in reversed(buckets):
                for with_lora in self.lora_variants:
                    self._capture_one(size, bucket, with_lora)
        if self.lora_state is not None:
            self.lora_state.clear()
        torch.cuda.synchronize(self.device)
        logger.info("Captured %d CUDA graphs for speculative verify steps (%d tokens per request, batch %d..%d) "
                    "in %.1f s.", len(self.graphs), self.query_len, self.sizes[0], self.sizes[-1],
                    time.perf_counter() - start)

    def _capture_one(self, size: int, bucket: int, with_lora: bool) -> None:
        model = self.runner.model
        backend = self.runner.attn_backend
        tokens = size * self.query_len
        if self.lora_state is not None:
            self.lora_state.clear()  # no adapter tokens while capturing: the LoRA kernels exit at once
            self.lora_state.active = with_lora
        md = self._metadata(size, bucket)
        with set_forward_context(md, backend):
            backend.prepare(md)
            for _ in range(2):  # warm-up: compile outside the capture
                model(self.input_ids[:tokens], self.positions[:tokens])
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = model(self.input_ids[:tokens], self.positions[:tokens])
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(size, bucket, with_lora)] = graph
        self.outputs[(size, bucket, with_lora)] = out

    def bucket(self, num_reqs: int, max_query_len: int) -> Optional[int]:
        """The batch bucket of a step, or None when it is not a verify-shaped step (pure decode has its own
        graphs; longer query chunks take the mixed-step graphs)."""
        if not 1 < max_query_len <= self.query_len or num_reqs > self.max_size:
            return None
        return next(s for s in self.sizes if s >= num_reqs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            md: AttentionMetadata) -> Optional[torch.Tensor]:
        size = self.bucket(md.num_reqs, md.max_query_len)
        if size is None:
            return None
        n, r = input_ids.shape[0], md.num_reqs
        tokens = size * self.query_len
        pad_rows(self.input_ids, input_ids, tokens, 0)
        pad_rows(self.positions, positions, tokens, 0)
        pad_rows(self.slot_mapping, md.slot_mapping, tokens, self.scratch_slot)
        pad_rows(self.query_start_loc, md.query_start_loc, size + 1, n)  # padding rows: no query tokens
        pad_rows(self.seq_lens, md.seq_lens, size, 0)
        nb = md.block_table.shape[1]
        self.block_table[:r, :nb].copy_(md.block_table, non_blocking=True)
        context = next(b for b in self.seq_len_buckets[size] if b >= md.max_seq_len)
        self.runner.attn_backend.prepare(md)
        key = (size, context, self.lora_state is not None and self.lora_state.active)
        self.graphs[key].replay()
        self.num_replays += 1
        return self.outputs[key][:n]
