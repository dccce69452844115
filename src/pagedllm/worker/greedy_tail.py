"""Greedy tails: the LM head and the argmax of a greedy step replayed as a CUDA graph of their own.

A decode step (and a batch-1 verify step) of a small model is host-bound: the forward is one graph replay, but
the LM head's GEMV and the split argmax after it were eager launches, each costing the host more than a replay
(docs/benchmarks.md, "Where a SmolLM2 step's host time goes"). Each decode / mixed graph of few rows therefore gets
a tail graph that reads that graph's output and writes the argmax token ids into one persistent buffer.

The buffer is shared by every tail and rewritten at the next tail replay: each consumer of a step's ids (the host
copy, the next step's inputs, the device n-gram kernels) is enqueued on the stream before the next step's graphs,
so it reads them first. Tails apply without a token bitmask only (structured outputs take the eager path).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from pagedllm import envs

logger = logging.getLogger("pagedllm")


class GreedyTails:
    """Tail graphs keyed as the graphs whose outputs they read; `replay(key, hidden)` after that graph's replay."""

    def __init__(self, runner) -> None:
        from pagedllm.kernels.argmax import MAX_SPLIT_ROWS

        self.runner = runner
        # Up to the split argmax's rows: larger batches are not host-bound, and their logits would grow the pool.
        self.max_rows = MAX_SPLIT_ROWS if envs.PAGEDLLM_GRAPH_GREEDY else 0
        self.ids = torch.zeros(max(self.max_rows, 1), dtype=torch.long, device=runner.device)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.inputs: dict[tuple, torch.Tensor] = {}
        self.num_replays = 0  # (tests and benchmarks read it)

    def capture(self, key: tuple, hidden: Optional[torch.Tensor], pool) -> None:
        """After the graph `key` (output `hidden`) is captured, into the same pool."""
        if hidden is None or hidden.dim() != 2 or not 0 < hidden.shape[0] <= self.max_rows:
            return
        fn = getattr(self.runner.model, "greedy_token_ids", None)
        if fn is None or fn(hidden) is None:  # (also the warm-up) this model's LM head has no device shortcut
            self.max_rows = 0
            return
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool):
                self.ids[:hidden.shape[0]].copy_(fn(hidden))
        except RuntimeError as e:  # an LM head that cannot be captured: greedy steps run it eagerly
            logger.warning("The LM head + argmax of greedy steps run outside CUDA graphs: capturing them failed "
                           "(%s).", e)
            self.max_rows = 0
            self.graphs.clear()
            self.inputs.clear()
            return
        self.graphs[key] = graph
        self.inputs[key] = hidden

    def replay(self, key: Optional[tuple], hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """The argmax token ids of `hidden`, rows of graph `key`'s output as its last replay left them; None where
        `key` has no tail or `hidden` is another tensor."""
        graph = self.graphs.get(key)
        if graph is None or hidden.dim() != 2 or hidden.data_ptr() != self.inputs[key].data_ptr():
            return None
        graph.replay()
        self.num_replays += 1
        return self.ids[:hidden.shape[0]]
