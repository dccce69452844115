"""Mixed prefill + decode steps as piecewise CUDA graphs, one set per token-count bucket.

A mixed step's attention launch depends on per-step host ints (number of requests, longest query chunk), so
the whole forward cannot be one graph. Everything else in a layer (norms, projections, MLP, residual adds)
depends only on the token count. So for each token bucket the forward is captured as `num_layers + 1` graph
pieces that end and begin at every attention call (`GraphSplitter`); at replay the pieces run in order and
each attention call runs eagerly in between, with the step's own metadata, reading the q/k/v the previous piece
left in its static buffer and writing into one static output buffer that the next piece reads.

A step of n tokens is padded to the smallest bucket >= n: padding rows carry token 0 at position 0, write their
K/V into the scratch block (as decode-graph padding does) and belong to no request, so attention never reads
them and no other row depends on them (every op in the pieces is row-wise or a GEMM over rows).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from pagedllm import envs
from pagedllm.forward_context import AttentionMetadata, set_forward_context

logger = logging.getLogger("pagedllm")


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """Token buckets for mixed-step graphs: fine steps for small counts (where padding would be a large
    fraction of the step), coarser above; the last is `max_tokens`."""
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


def pad_slot_mapping(static: torch.Tensor, slot_mapping: torch.Tensor, size: int, scratch_slot: int) -> torch.Tensor:
    """Write the step's slot mapping into the static buffer and point the padding rows at the scratch slot."""
    n = slot_mapping.shape[0]
    static[:n].copy_(slot_mapping, non_blocking=True)
    if size > n:
        static[n:size].fill_(scratch_slot)
    return static[:size]


class GraphSplitter:
    """Captures a forward as graph pieces separated by eager calls.

    While capturing, `split(call)` ends the current piece, runs `call()` now (on the capture stream, outside any
    graph), remembers it, and begins the next piece. `call` must read everything that varies per step from the
    forward context at call time and write its result into a static buffer, so calling it again at replay gives
    the step's answer where the next piece looks for it.
    """

    def __init__(self, pool) -> None:
        self.pool = pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.calls: list[Callable[[], object]] = []
        self._begin()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.pieces.append(graph)

    def _end(self) -> None:
        self.pieces[-1].capture_end()
        if self.pool is None:
            self.pool = self.pieces[-1].pool()

    def split(self, call: Callable[[], object]):
        self._end()
        result = call()
        self.calls.append(call)
        self._begin()
        return result

    def finish(self) -> None:
        self._end()

    def replay(self) -> None:
        for graph, call in zip(self.pieces, self.calls):
            graph.replay()
            call()
        self.pieces[-1].replay()


class PiecewiseGraphRunner:
    """Capture and replay of mixed steps in token buckets (see the module docstring)."""

    def __init__(self, runner, pool=None) -> None:
        self.runner = runner
        self.device = runner.device
        max_tokens = min(runner.max_num_batched_tokens, envs.PAGEDLLM_MIXED_GRAPH_MAX_TOKENS)
        self.sizes = mixed_capture_sizes(max_tokens) if max_tokens > 0 else []
        self.max_size = self.sizes[-1] if self.sizes else 0
        self.scratch_slot = runner.scratch_block * runner.block_size
        n, dev = max(self.max_size, 1), self.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        first = runner.model.attn_layers[0]
        # One attention output buffer shared by every layer and bucket: layer l's output is read by the piece
        # after it before layer l + 1's attention (the next eager call) overwrites it.
        self.attn_output = torch.zeros(n, first.num_heads * first.head_size, dtype=runner.dtype, device=dev)
        self.graphs: dict[int, GraphSplitter] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool
        self.num_replays = 0  # steps served by a graph (tests and benchmarks read it)

    def _capture_metadata(self, size: int) -> AttentionMetadata:
        """Requests of at most max_model_len tokens covering `size` tokens, every K/V write going to the scratch
        slot and every block-table entry naming the scratch block: real kernels, harmless writes."""
        dev = self.device
        chunk = min(size, self.runner.max_model_len)
        starts = list(range(0, size, chunk)) + [size]
        lens = [b - a for a, b in zip(starts, starts[1:])]
        return AttentionMetadata(
            num_actual_tokens=size, num_reqs=len(lens), max_query_len=max(lens), max_seq_len=max(lens),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_table=torch.full((len(lens), self.runner.max_blocks_per_req), self.runner.scratch_block,
                                   dtype=torch.int32, device=dev),
            slot_mapping=self.slot_mapping[:size], query_start_loc_cpu=starts, seq_lens_cpu=lens)

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.sizes:
            return
        start = time.perf_counter()
        model = self.runner.model
        backend = self.runner.attn_backend
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):  # largest first so smaller buckets reuse its pool memory
            md = self._capture_metadata(size)
            with set_forward_context(md, backend):
                backend.prepare(md)
                model(self.input_ids[:size], self.positions[:size])  # warm-up: compile outside the capture
                torch.cuda.synchronize(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    splitter = GraphSplitter(self.pool)
                    with set_forward_context(md, backend, graph_splitter=splitter,
                                             attn_output=self.attn_output):
                        out = model(self.input_ids[:size], self.positions[:size])
                    splitter.finish()
                torch.cuda.current_stream(self.device).wait_stream(stream)
            self.pool = splitter.pool
            self.graphs[size] = splitter
            self.outputs[size] = out
        torch.cuda.synchronize(self.device)
        logger.info("Captured mixed-step CUDA graphs for %d token buckets %d..%d (%d pieces each) in %.1f s.",
                    len(self.sizes), self.sizes[0], self.sizes[-1], len(self.graphs[self.sizes[0]].pieces),
                    time.perf_counter() - start)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            md: AttentionMetadata) -> Optional[torch.Tensor]:
        n = input_ids.shape[0]
        size = bucket_for(self.sizes, n)
        if size is None:
            return None
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if size > n:  # padding rows: token 0 at position 0 (a larger step may have left other values)
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
        md.slot_mapping = pad_slot_mapping(self.slot_mapping, md.slot_mapping, size, self.scratch_slot)
        backend = self.runner.attn_backend
        backend.prepare(md)
        with set_forward_context(md, backend):
            self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:n]
