"""The offline LLM's Prometheus metrics (`LLM.get_metrics()`, vLLM's): what AsyncEngine records for the server,
recorded by LLM._run as the engine steps, in a registry of this LLM's own (two LLMs in one process count apart).

Kept only with `disable_log_stats=False`, as in vLLM (its offline LLM's default is True and get_metrics() fails).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Container, Iterable, Optional

from pagedllm.metrics import Metrics
from pagedllm.metrics.reader import Metric, get_metrics_snapshot


@dataclass
class _Timing:
    """One engine request's clock (time.monotonic) and counts, for the latency and token histograms."""
    arrival: float
    num_prompt_tokens: int
    max_tokens: int
    group: Optional["_Group"]  # n > 1: what its samples share
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    num_generated: int = 0
    queued: Optional[float] = None  # engine-side seconds before its first scheduling


@dataclass
class _Group:
    """The samples of one n > 1 request: vllm:request_params_n and the max generation histogram once per request."""
    parent_id: str
    n: int
    left: int
    max_generated: int = 0


class OfflineMetrics:
    def __init__(self, model_name: str, max_model_len: int, cache_config: dict[str, str]) -> None:
        self.metrics = Metrics(model_name)
        self.metrics.engine_ready(0, max_model_len, cache_config)  # max_tokens buckets, vllm:cache_config_info
        self.max_model_len = max_model_len
        self._timing: dict[str, _Timing] = {}
        self._groups: dict[str, _Group] = {}

    def add_request(self, request_id: str, num_prompt_tokens: int, params: Any, parent_id: Optional[str]) -> None:
        """An engine request (one sample of a user request), when it is handed to the engine."""
        group = None
        if params.n > 1 and parent_id is not None:
            group = self._groups.setdefault(parent_id, _Group(parent_id, params.n, params.n))
        max_tokens = params.max_tokens
        if getattr(params, "pooling", None) is not None:
            max_tokens = 0  # an embedding has no max_tokens parameter (vLLM observes none)
        elif max_tokens is None:  # the engine's default: the room the prompt leaves (as AsyncEngine records it)
            max_tokens = self.max_model_len - num_prompt_tokens
        self._timing[request_id] = _Timing(time.monotonic(), num_prompt_tokens, max_tokens, group)

    def step(self, outputs: Iterable[Any], stopped: Container[str] = ()) -> None:
        """One engine step's outputs. `stopped`: the requests a stop string ended (counted "stop", as vLLM does,
        whatever the engine said)."""
        now = time.monotonic()
        m = self.metrics
        new_tokens = prompt_tokens = 0
        gaps: list[float] = []
        for out in outputs:
            t = self._timing.get(out.request_id)
            if t is None:
                continue
            if out.queued_s is not None:
                t.queued = out.queued_s
            n_new = len(out.new_token_ids)
            # an embedding's result is its first output: its prompt and TTFT count, as vLLM counts them
            if n_new or (out.pooled is not None and t.first_token is None):
                new_tokens += n_new
                t.num_generated += n_new
                if t.first_token is None:
                    # the prompt counts with the first token, in that step (vLLM's vllm:prompt_tokens)
                    t.first_token = now
                    m.observe_first_token(now - t.arrival, t.num_prompt_tokens)
                    prompt_tokens += t.num_prompt_tokens
                else:
                    gaps.append(now - t.last_token)
                t.last_token = now
            if out.finish_reason is not None:
                self.finish(out.request_id, "stop" if out.request_id in stopped else out.finish_reason, now)
        if new_tokens:
            m.add_generation_tokens(new_tokens)
            m.observe_gaps(gaps)
        if new_tokens or prompt_tokens:
            m.observe_iteration_tokens(new_tokens + prompt_tokens)

    def finish(self, request_id: str, reason: str, now: Optional[float] = None) -> None:
        """A request ended: request_success and the per-request histograms, once (a later call is a no-op)."""
        t = self._timing.pop(request_id, None)
        if t is None:
            return
        now = time.monotonic() if now is None else now
        tpot = phases = None
        if t.first_token is not None and t.num_generated > 1:
            tpot = (t.last_token - t.first_token) / (t.num_generated - 1)
        if t.queued is not None and t.first_token is not None:
            # (queue, prefill, decode): prefill runs from the first scheduling to the first token
            phases = (t.queued, max(0.0, t.first_token - t.arrival - t.queued), t.last_token - t.first_token)
        samples: Optional[tuple[int, int]] = (1, t.num_generated)
        if t.group is not None:  # n > 1: once per user request, with its last sample
            t.group.left -= 1
            t.group.max_generated = max(t.group.max_generated, t.num_generated)
            samples = (t.group.n, t.group.max_generated) if t.group.left == 0 else None
            if t.group.left == 0:
                self._groups.pop(t.group.parent_id, None)
        self.metrics.observe_finished(reason, now - t.arrival, tpot, num_prompt=t.num_prompt_tokens,
                                      num_generated=t.num_generated, phases=phases, max_tokens=t.max_tokens,
                                      samples=samples)

    def snapshot(self, stats: Any) -> list[Metric]:
        """The `vllm:` series now; `stats`: the engine's SchedulerStats (gauges, prefix cache, spec decode), None
        to keep the last ones (an LLM shut down)."""
        if stats is not None:
            self.metrics.update_scheduler_stats(stats)
        return get_metrics_snapshot(self.metrics.registry)
