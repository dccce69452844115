"""Pure functions behind the dashboard's numbers: what the Prometheus collectors already count, read back and turned
into rates and windowed percentiles, and the KV pool's state bytes turned into grid cells.

Percentiles come from the latency histograms the way Prometheus' `histogram_quantile` computes them (linear inside
the bucket that holds the rank; the highest finite bound for ranks in the +Inf bucket), over the difference of two
cumulative readings: the dashboard shows what a Grafana panel on /metrics would show, at the buckets' resolution.
"""
from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

# Prometheus family names (pagedllm.metrics) -> our keys
_COUNTERS = {"vllm:prompt_tokens": "prompt_tokens", "vllm:generation_tokens": "generation_tokens",
             "vllm:request_success": "finished_requests"}
# (tpot: each request's mean gap after its first token, as the benchmark clients report TPOT)
HISTOGRAMS = {"vllm:time_to_first_token_seconds": "ttft", "vllm:request_time_per_output_token_seconds": "tpot",
              "vllm:e2e_request_latency_seconds": "e2e"}
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Histogram:
    """Cumulative bucket counts (Prometheus `le` buckets, the last one +Inf), summed over engines."""

    bounds: tuple[float, ...] = ()
    counts: list[float] = field(default_factory=list)

    def minus(self, earlier: "Histogram") -> "Histogram":
        if earlier.bounds != self.bounds:  # nothing earlier (or another layout): everything counts
            return self
        return Histogram(self.bounds, [a - b for a, b in zip(self.counts, earlier.counts)])

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0


@dataclass
class Reading:
    """One reading of the counters at `t` (time.monotonic())."""

    t: float
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)


def read_registry(registry: Any, t: float) -> Reading:
    """The token / request counters and latency histograms of a prometheus_client registry, summed over the
    `engine` (and other) labels. Uses only the registry's public collect()."""
    reading = Reading(t)
    if registry is None:
        return reading
    buckets: dict[str, dict[float, float]] = {}
    for family in registry.collect():
        key = _COUNTERS.get(family.name)
        if key is not None:
            reading.counters[key] = sum(s.value for s in family.samples if s.name.endswith("_total"))
            continue
        key = HISTOGRAMS.get(family.name)
        if key is None:
            continue
        per = buckets.setdefault(key, {})
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                per[le] = per.get(le, 0.0) + s.value
    for key, per in buckets.items():
        bounds = tuple(sorted(per))
        reading.histograms[key] = Histogram(bounds, [per[b] for b in bounds])
    return reading


def histogram_quantile(q: float, hist: Histogram) -> Optional[float]:
    """Prometheus' histogram_quantile over cumulative `le` buckets; None without observations."""
    total = hist.total
    if total <= 0 or not hist.bounds:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in zip(hist.bounds, hist.counts):
        if count >= rank and count > prev_count:
            if math.isinf(bound):  # the rank is past the last finite bucket
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def latency_summary(hist: Histogram) -> dict:
    out: dict = {"count": int(round(hist.total))}
    for q in QUANTILES:
        value = histogram_quantile(q, hist)
        out[f"p{round(q * 100)}"] = None if value is None else round(value, 6)
    return out


def rate(now: float, then: float, seconds: float) -> float:
    return max(0.0, now - then) / seconds if seconds > 0 else 0.0


def ratio(part: float, whole: float) -> Optional[float]:
    return part / whole if whole > 0 else None


# ---- the KV grid ------------------------------------------------------------------------------------------------

# core/block_pool's state values, in the order a grid cell that stands for several blocks prefers them on a tie
STATE_NAMES = ("free", "cached", "used", "shared")


def state_counts(states: bytes) -> dict[str, int]:
    return {name: states.count(value) for value, name in enumerate(STATE_NAMES)}


def grid_cells(states: bytes, max_cells: int) -> tuple[bytes, int]:
    """(one state byte per cell, blocks per cell). Up to max_cells blocks: one cell per block; more: each cell
    stands for k consecutive blocks and shows the state most of them are in (in use wins a tie)."""
    n = len(states)
    if n <= max_cells:
        return bytes(states), 1
    import numpy as np

    k = -(-n // max_cells)
    cells = -(-n // k)
    a = np.zeros(cells * k, dtype=np.uint8)
    a[:n] = np.frombuffer(states, dtype=np.uint8)
    a = a.reshape(cells, k)
    # counts per state, highest state first so argmax's first-maximum rule prefers the busier state
    order = np.arange(len(STATE_NAMES) - 1, -1, -1, dtype=np.uint8)
    counts = np.stack([(a == v).sum(axis=1, dtype=np.int32) for v in order], axis=1)
    return order[counts.argmax(axis=1)].tobytes(), k


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def sum_stats(stats: Iterable[Any], names: Iterable[str]) -> dict[str, float]:
    stats = list(stats)
    return {n: float(sum(getattr(s, n, 0) or 0 for s in stats)) for n in names}
