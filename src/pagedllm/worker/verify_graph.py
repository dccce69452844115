"""Speculative verify steps as captured CUDA graphs: up to k + 1 query tokens per request, one graph per
(batch-size bucket, context bucket), sharing the decode graphs' memory pool.

A verify step of r requests (each 1 + its drafts tokens, at most k + 1) is padded to the smallest batch bucket
b >= r and to b * (k + 1) tokens. The captured forward is the decode step's, with k + 1 rows per request: the
linear layers see b * (k + 1) rows (the few-row GEMV / skinny-GEMM kernels at small b) and attention runs the
split-KV decode kernel with k + 1 query tokens per request (kernels/paged_attention.py) with the decode split
count of batch b, so the launch
depends on (b, context bucket) only, as for decode graphs (AttentionBackend.graph_seq_len_buckets).

The static inputs and their padding are the mixed-step graphs' (worker/graph_inputs.py: one set of buffers for
both).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from pagedllm import envs
from pagedllm.forward_context import AttentionMetadata, set_forward_context
from pagedllm.worker.cuda_graph import capture_sizes
from pagedllm.worker.graph_inputs import GraphInputs

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
        # The static inputs (worker/graph_inputs.py), shared with the mixed-step graphs: set before capture.
        self.inputs: Optional[GraphInputs] = None
        self.tokens_needed, self.reqs_needed = self.max_size * query_len, self.max_size
        self.seq_len_buckets: dict[int, list[int]] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (batch bucket, context bucket, with LoRA) -> graph
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.lora_state = runner.lora.state if getattr(runner, "lora", None) is not None else None
        self.lora_variants = (False, True) if self.lora_state is not None else (False,)
        self.pool = pool
        self.num_replays = 0  # steps served by a graph (tests and benchmarks read it)

    def _metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        return self.inputs.metadata(size * self.query_len, size, self.query_len, max_seq_len)

    @torch.inference_mode()
    def capture(self) -> None:
        if self.inputs is None:
            self.inputs = GraphInputs(self.runner, self.tokens_needed, self.reqs_needed)
        start = time.perf_counter()
        backend = self.runner.attn_backend
        num_kv_heads = self.runner.kv_cache_spec().num_kv_heads
        for size in reversed(self.sizes):  # largest first so smaller graphs reuse its pool memory
            # Capture inputs: every request has k + 1 tokens in the scratch block.
            self.inputs.query_start_loc[:size + 1].copy_(torch.arange(size + 1, dtype=torch.int32) * self.query_len)
            self.inputs.seq_lens[:size].fill_(self.query_len)
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
            ids, pos = self.inputs.input_ids[:tokens], self.inputs.positions[:tokens]
            for _ in range(2):  # warm-up: compile outside the capture
                model(ids, pos)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = model(ids, pos)
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
        n = input_ids.shape[0]
        self.inputs.load(input_ids, positions, md, size * self.query_len, size)
        context = next(b for b in self.seq_len_buckets[size] if b >= md.max_seq_len)
        self.runner.attn_backend.prepare(md)
        key = (size, context, self.lora_state is not None and self.lora_state.active)
        self.graphs[key].replay()
        self.num_replays += 1
        return self.outputs[key][:n]
