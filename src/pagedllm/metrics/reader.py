"""vLLM's `vllm.v1.metrics.reader`: the Prometheus metrics as plain dataclasses, what `LLM.get_metrics()` returns.

Only the `vllm:` families are read (pagedllm's own `pagedllm:` ones stay /metrics-only, as vLLM leaves out every
family not its own). Counters drop prometheus_client's `_total` suffix from their name, as vLLM's reader does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["Metric", "Counter", "Gauge", "Vector", "Histogram", "get_metrics_snapshot"]

# The one counter family that comes as a Vector: a counter per draft position (label "position").
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    """One series: a family's name and the labels of this series (a family has one series per label set)."""
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""
    value: int


@dataclass
class Vector(Metric):
    """Integer counters by position: vllm:spec_decode_num_accepted_tokens_per_pos, values[i] for draft position i."""
    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""
    value: float


@dataclass
class Histogram(Metric):
    """Observations by bucket: `buckets` maps each upper bound (as Prometheus writes it, "+Inf" included) to the
    observations up to it (cumulative); `count` is the "+Inf" bucket's, `sum` the observed values' total."""
    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: Any) -> list[Metric]:
    """Every `vllm:` series of a prometheus_client registry (anything with collect()), as vLLM's reader gives them
    (vLLM reads its global REGISTRY; pagedllm's offline LLM has a registry of its own)."""
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "gauge":
            collected.extend(Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples)
        elif family.type == "counter":
            samples = [s for s in family.samples if s.name.endswith("_total")]  # not the _created ones
            if family.name == _PER_POSITION:
                collected.extend(Vector(family.name, labels, values) for labels, values in _by_position(samples))
            else:
                collected.extend(Counter(family.name, dict(s.labels), int(s.value)) for s in samples)
        elif family.type == "histogram":
            collected.extend(_histograms(family.name, family.samples))
        else:
            raise AssertionError(f"Unknown metric type {family.type}")
    return collected


def _key(labels: dict[str, str], *drop: str) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in drop))


def _by_position(samples: Iterable[Any]) -> list[tuple[dict[str, str], list[int]]]:
    """The per-position counters of each label set (position aside) as one list, index = position."""
    series: dict[tuple, dict[int, int]] = {}
    for s in samples:
        series.setdefault(_key(s.labels, "position"), {})[int(s.labels["position"])] = int(s.value)
    return [(dict(key), [by_pos.get(i, 0) for i in range(max(by_pos) + 1)]) for key, by_pos in series.items()]


def _histograms(name: str, samples: Iterable[Any]) -> list[Histogram]:
    """A histogram family's samples (_bucket by `le`, _count, _sum) regrouped into one Histogram per label set."""
    found: dict[tuple, Histogram] = {}

    def series(labels: dict[str, str]) -> Histogram:
        key = _key(labels, "le")
        if key not in found:
            found[key] = Histogram(name, dict(key), 0, 0.0, {})
        return found[key]

    for s in samples:
        if s.name.endswith("_bucket"):
            series(s.labels).buckets[s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            series(s.labels).count = int(s.value)
        elif s.name.endswith("_sum"):
            series(s.labels).sum = float(s.value)
    return list(found.values())
