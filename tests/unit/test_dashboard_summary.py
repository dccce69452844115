"""The dashboard's arithmetic (entrypoints/dashboard/summary.py): percentiles from Prometheus histograms (against
hand-computed values and against numpy's quantiles of the observed samples), the counters read back from a real
`Metrics` registry summed over engines, and the KV grid's cells against a plain per-cell count."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from pagedllm.entrypoints.dashboard import summary as s
from pagedllm.metrics import Metrics


def test_histogram_quantile_by_hand() -> None:
    # 2 observations <= 1, 2 more <= 2, none above: Prometheus interpolates linearly inside the bucket
    h = s.Histogram((1.0, 2.0, math.inf), [2.0, 4.0, 4.0])
    assert s.histogram_quantile(0.5, h) == pytest.approx(1.0)  # rank 2: the top of the first bucket
    assert s.histogram_quantile(0.25, h) == pytest.approx(0.5)
    assert s.histogram_quantile(0.9, h) == pytest.approx(1.8)  # rank 3.6: 1 + (3.6 - 2) / 2
    # ranks in the +Inf bucket: the highest finite bound (as histogram_quantile does)
    high = s.Histogram((1.0, 2.0, math.inf), [1.0, 1.0, 10.0])
    assert s.histogram_quantile(0.99, high) == 2.0
    assert s.histogram_quantile(0.5, s.Histogram((1.0, math.inf), [0.0, 0.0])) is None
    assert s.histogram_quantile(0.5, s.Histogram()) is None
    # a window: the difference of two cumulative readings
    later = s.Histogram((1.0, 2.0, math.inf), [5.0, 9.0, 9.0])
    assert later.minus(h).counts == [3.0, 5.0, 5.0]
    assert s.histogram_quantile(0.5, later.minus(h)) == pytest.approx(2.5 / 3)  # rank 2.5 of 3 in the first bucket


def test_quantiles_from_metrics_are_within_a_bucket_of_the_samples() -> None:
    """Observe latencies into the server's own TTFT histogram, read them back: each percentile lies in the bucket
    that holds numpy's percentile of the samples."""
    metrics = Metrics("m", num_engines=2)
    rng = random.Random(0)
    samples = [rng.lognormvariate(-2.0, 0.8) for _ in range(2000)]
    for i, x in enumerate(samples):
        metrics.observe_first_token(x, 10, engine=i % 2)
    reading = s.read_registry(metrics.registry, t=0.0)
    hist = reading.histograms["ttft"]
    assert hist.total == len(samples) and reading.counters["prompt_tokens"] == 10 * len(samples)
    bounds = (0.0,) + hist.bounds
    for q in s.QUANTILES:
        got = s.histogram_quantile(q, hist)
        exact = float(np.quantile(samples, q))
        i = next(k for k, b in enumerate(hist.bounds) if exact <= b)
        assert bounds[i] <= got <= bounds[i + 1], (q, got, exact, bounds[i], bounds[i + 1])
    summary = s.latency_summary(hist)
    assert summary["count"] == len(samples) and summary["p50"] <= summary["p90"] <= summary["p99"]


def test_read_registry_sums_engines_and_finish_reasons() -> None:
    metrics = Metrics("m", num_engines=3)
    for engine in range(3):
        metrics.add_generation_tokens(5 + engine, engine)
        metrics.observe_finished("stop", 0.5, 0.01, engine)
    metrics.observe_finished("length", 1.5, None, 0)
    reading = s.read_registry(metrics.registry, t=1.0)
    assert reading.counters["generation_tokens"] == 18 and reading.counters["finished_requests"] == 4
    assert reading.histograms["e2e"].total == 4 and reading.histograms["tpot"].total == 3
    assert s.read_registry(None, t=0.0).counters == {}


def _cells_reference(states: bytes, k: int) -> bytes:
    out = []
    for start in range(0, len(states), k):
        chunk = list(states[start:start + k]) + [0] * max(0, start + k - len(states))
        counts = [chunk.count(v) for v in range(4)]
        best = max(counts)
        out.append(max(v for v in range(4) if counts[v] == best))  # a tie goes to the busier state
    return bytes(out)


@pytest.mark.parametrize("n", [1, 100, 4096, 4097, 10_000, 123_457])
def test_grid_cells(n: int) -> None:
    rng = random.Random(n)
    # runs of one state, like a pool's real layout
    states = bytearray()
    while len(states) < n:
        states += bytes([rng.choice([0, 0, 1, 2, 2, 3])]) * rng.randrange(1, 40)
    states = bytes(states[:n])
    cells, k = s.grid_cells(states, 4096)
    assert k == max(1, -(-n // 4096)) and len(cells) == -(-n // k) <= 4096
    assert cells == (states if k == 1 else _cells_reference(states, k))
    assert s.state_counts(states) == {name: states.count(v) for v, name in enumerate(s.STATE_NAMES)}
