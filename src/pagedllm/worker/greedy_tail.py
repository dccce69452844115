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


# The sampling parameters a sampled tail takes, in the order of its parameter buffer's rows.
_SAMPLE_FIELDS = ("temperature", "top_p", "min_p")
_SEED_MASK = (1 << 62) - 1  # the sampler's per-row keys are non-negative (a negative one means "none")
_ROW_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # spreads the rows' keys apart (as the sampler's kernel does)
_STEP_MIX = 0x632BE59BD9B4E019  # advances the step's key at every replay


class SampleTails:
    """Sampled decode steps' LM head + device sampler (kernels/sampling.py) as graphs, for steps whose rows use
    temperature, top-p and min-p only (no seed, top-k, penalty, logprobs, min_tokens, constraint or grammar mask;
    greedy rows among them take their argmax as in the kernel). One graph per (decode graph, parameters present),
    captured at its first use. The step's parameters are copied into one static buffer before the replay; each
    row's random key is derived on the device from a step counter the graph advances (the eager path draws one key
    per step from torch's generator; the counter starts from it, so torch.manual_seed still makes runs repeat)."""

    def __init__(self, runner, max_rows: int) -> None:
        self.runner = runner
        self.max_rows = max_rows if envs.PAGEDLLM_GRAPH_SAMPLE else 0
        dev = runner.device
        n = max(self.max_rows, 1)
        self.params = torch.zeros(len(_SAMPLE_FIELDS), n, dtype=torch.float32, device=dev)
        self.params[0].fill_(1.0)  # (temperature 1, top-p 0, min-p 0 in rows a step never wrote)
        self.row_mix = torch.arange(n, dtype=torch.int64, device=dev) * _ROW_MIX
        self.step_key = torch.zeros(1, dtype=torch.int64, device=dev)
        self.seeded = False
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.graphs: dict[tuple, Optional[torch.cuda.CUDAGraph]] = {}  # None: capturing it failed
        self.num_replays = 0

    def applies(self, meta, names) -> bool:
        """The step's sampling is what a sampled tail computes."""
        from pagedllm.layers import sampler

        return (self.max_rows > 0 and meta.temperature is not None and not meta.all_greedy and meta.no_top_k
                and meta.no_penalties and not meta.seeds and meta.max_num_logprobs is None
                and meta.min_tokens_mask is None and meta.constraints is None and meta.token_bitmask is None
                and set(names) <= set(_SAMPLE_FIELDS) and "temperature" in names and sampler.DEVICE_SAMPLING
                and sampler.TOP_K_TOP_P_IMPL == "auto")

    def _sample(self, hidden: torch.Tensor, names: tuple) -> torch.Tensor:
        """What the graph holds: logits, the rows' keys (the step counter advanced), the draw into `ids`."""
        from pagedllm.layers.sampler import _GREEDY_EPS
        from pagedllm.kernels.sampling import sample_rows

        size = hidden.shape[0]
        logits = self.runner.model.compute_logits(hidden)
        rows = {name: self.params[i, :size] for i, name in enumerate(names)}
        seeds = torch.bitwise_and(self.step_key + self.row_mix[:size], _SEED_MASK)
        self.step_key.add_(_STEP_MIX)
        out = sample_rows(logits, rows["temperature"], 1 << 40, seeds=seeds, min_p=rows.get("min_p"),
                          top_p=rows.get("top_p"), greedy_eps=_GREEDY_EPS)
        self.ids[:size].copy_(out)
        return out

    def _capture(self, hidden: torch.Tensor, names: tuple, pool) -> Optional[torch.cuda.CUDAGraph]:
        if not self.seeded:  # the counter's start: one draw from torch's generator, as the eager path's step key
            self.step_key.fill_(int(torch.randint(1 << 40, 1 << 62, (1,)).item()))
            self.seeded = True
        torch.cuda.synchronize(self.runner.device)
        key_now = self.step_key.clone()
        graph = torch.cuda.CUDAGraph()
        try:  # (out of memory too: a graph's logits at many rows need pool memory of their own)
            self._sample(hidden, names)  # warm-up: compiles outside the capture
            torch.cuda.synchronize(self.runner.device)
            with torch.cuda.graph(graph, pool=pool):
                self._sample(hidden, names)
        except RuntimeError as e:
            logger.warning("Sampled decode steps of %d rows with %s run their LM head and sampler outside CUDA "
                           "graphs: capturing them failed (%s).", hidden.shape[0], ", ".join(names), e)
            graph = None
        self.step_key.copy_(key_now)  # (the warm-up's draw and the capture's advance are not steps)
        return graph

    def replay(self, key: Optional[tuple], hidden: torch.Tensor, graph_out: Optional[torch.Tensor], meta,
               floats: torch.Tensor, names, pool) -> Optional[torch.Tensor]:
        """The sampled token ids of `hidden` (rows of graph `key`'s output `graph_out`), or None where no tail
        applies. floats: the step's parameters [len(names), rows] on the device, named by `names`."""
        n = hidden.shape[0]
        if (key is None or graph_out is None or hidden.dim() != 2 or hidden.data_ptr() != graph_out.data_ptr()
                or graph_out.shape[0] > self.max_rows or not self.applies(meta, names)):
            return None
        names = tuple(names)
        gkey = (key, names)
        if gkey not in self.graphs:
            self.graphs[gkey] = self._capture(graph_out, names, pool)
        graph = self.graphs[gkey]
        if graph is None:
            return None
        self.params[:len(names), :n].copy_(floats, non_blocking=True)
        graph.replay()
        self.num_replays += 1
        return self.ids[:n]
