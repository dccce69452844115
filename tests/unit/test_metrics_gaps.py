"""Inter-token gaps in /metrics (metrics.Metrics.observe_gaps): vLLM's per-iteration
vllm:inter_token_latency_seconds and its older name time_per_output_token_seconds, recorded in bulk, give the
histogram that one observe() per gap gives; each request's mean stays in request_time_per_output_token_seconds."""
from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.metrics import _TPOT_BUCKETS, Metrics, _observe_all


def _samples(registry: CollectorRegistry, text: bytes = b"") -> dict:
    from prometheus_client import generate_latest

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families((text or generate_latest(registry)).decode()) for s in f.samples}


def test_bulk_recording_equals_one_observe_per_value() -> None:
    rng = random.Random(0)
    # values on the bounds themselves (le is inclusive), between them, below the first and past the last
    values = list(_TPOT_BUCKETS) + [0.0, 1e-6, 1e6] + [rng.expovariate(20.0) for _ in range(500)]
    one, bulk = CollectorRegistry(), CollectorRegistry()
    a = Histogram("h", "doc", ["x"], buckets=_TPOT_BUCKETS, registry=one).labels("1")
    b = Histogram("h", "doc", ["x"], buckets=_TPOT_BUCKETS, registry=bulk).labels("1")
    for v in values:
        a.observe(v)
    _observe_all((b,), values[:100])
    _observe_all((b,), [])
    _observe_all((b,), values[100:])
    got, want = _samples(bulk), _samples(one)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key


def test_bulk_recording_falls_back_to_observe() -> None:
    """A histogram child laid out otherwise than prometheus_client's today still gets every value."""
    seen = []

    class Other:
        def observe(self, value):
            seen.append(value)

    _observe_all((Other(),), [0.5, 0.25])
    assert seen == [0.5, 0.25]


def test_gaps_go_to_both_names_and_the_request_mean_to_its_own() -> None:
    m = Metrics("m", num_engines=2)
    m.observe_gaps([0.02, 0.02, 0.3], engine=1)
    m.observe_finished("stop", 1.0, 0.1, engine=1)
    s = _samples(m.registry)

    def value(name: str, **labels: str) -> float:
        return sum(v for (n, lbls), v in s.items() if n == name and labels.items() <= dict(lbls).items())

    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert value(name + "_count", engine="1") == 3 and value(name + "_count", engine="0") == 0
        assert value(name + "_bucket", engine="1", le="0.025") == 2
        assert abs(value(name + "_sum", engine="1") - 0.34) < 1e-12
    assert value("vllm:request_time_per_output_token_seconds_count", engine="1") == 1
    assert value("vllm:request_time_per_output_token_seconds_sum", engine="1") == 0.1
