"""`from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector`: what `LLM.get_metrics()` returns,
pagedllm's own classes (isinstance checks on its results hold)."""
from __future__ import annotations

from pagedllm.metrics.reader import Counter, Gauge, Histogram, Metric, Vector, get_metrics_snapshot  # noqa: F401

__all__ = ["Metric", "Counter", "Gauge", "Vector", "Histogram", "get_metrics_snapshot"]
