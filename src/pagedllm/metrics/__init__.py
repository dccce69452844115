"""Prometheus metrics with vLLM's names (so existing Grafana dashboards work), labelled by model_name and engine.

Lives in the API process. Token counters and latency histograms are recorded by AsyncEngine as outputs arrive.
What the engine core reports (gauges, and its cumulative counts: preemptions, prefix cache, speculative decoding,
aborted requests) is rendered at scrape time from the latest SchedulerStats of each engine core, which the
/metrics route refreshes first: a counter's value is the engine's own running total, so every API process that
answers a scrape shows the same one.

Several API server processes (`--api-server-count`): each records its requests in prometheus_client's
multiprocess mode (`multiprocess_dir`, one file per process, summed at scrape by whichever process answers), so
counters and histograms add up over processes; `pagedllm:api_server_requests_total{api_server}` says how many
HTTP requests each process took.

The offline LLM keeps one too, in its own process (entrypoints/offline_metrics.py; read by `LLM.get_metrics()`
through reader.py).
"""
from __future__ import annotations

import time
from bisect import bisect_left
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the /metrics route
from prometheus_client import disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # the *_created series only add noise for dashboards

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets of token counts."""
    return tuple(float(m * 10 ** e) for e in range(len(str(max(1, max_value)))) for m in (1, 2, 5)
                 if m * 10 ** e <= max_value)


# Tokens per request (prompt / generated): up to a million (vLLM stops at max_model_len, unknown at construction)
_TOKEN_BUCKETS = buckets_1_2_5(1_000_000)
# vLLM's fixed buckets of tokens per engine step, and of the n request parameter
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's finish reasons (FINISH_REASON_STRINGS): vllm:request_success has a series for each from the start, so
# dashboards see them all before any request ended so ("error": a failed step; pagedllm never ends one "repetition").
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# The engine core's gauges and running totals: (metric name, help, SchedulerStats field).
_ENGINE_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in the running batch.", "num_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be scheduled.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    ("vllm:gpu_cache_usage_perc", "KV-cache usage (older name of kv_cache_usage_perc).", "kv_cache_usage"),
)
_ENGINE_COUNTERS = (
    ("vllm:num_preemptions", "Cumulative number of preemptions.", "num_preemptions"),
    ("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", "prefix_cache_hits"),
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_num_accepted_tokens"),
    ("pagedllm:engine_aborted_requests", "Requests the engine core finished as aborted: client disconnects, stop "
     "strings found by an API process, requests ended at shutdown.", "num_aborted"),
)


# vllm:engine_sleep_state's label values: one sample per state, 1 for the engine core's
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class _EngineChildren:
    """One engine core's labelled children of every family the API process records."""

    def __init__(self, families: dict[str, Any], model_name: str, engine: str) -> None:
        for name, family in families.items():
            if not name.startswith("_"):
                setattr(self, name, family.labels(model_name, engine))
        self.req_max_tokens: Any = None  # the max_model_len-bucketed ones: Metrics.engine_ready
        self.req_max_gen: Any = None
        success = families["_success_family"]
        self.success = {reason: success.labels(model_name, reason, engine) for reason in FINISH_REASONS}
        self._success_family, self._labels = success, (model_name, engine)

    def success_child(self, reason: str) -> Any:
        child = self.success.get(reason)
        if child is None:
            model_name, engine = self._labels
            child = self.success[reason] = self._success_family.labels(model_name, reason, engine)
        return child


class Metrics:
    """Every series is labelled by model_name and engine (the data-parallel engine core's index, "0" with one
    core), like vLLM; dashboards sum over `engine` for the server's totals.

    `multiprocess_dir`: this is one of several API server processes (index `api_server`), started with
    PROMETHEUS_MULTIPROC_DIR set to that directory (prometheus_client reads it at import)."""

    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None, num_engines: int = 1,
                 multiprocess_dir: Optional[str] = None, api_server: int = 0) -> None:
        # What render() exports: the families below (one process) or the multiprocess files, plus collectors.
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.multiprocess_dir = multiprocess_dir
        # Several processes: the families' values live in the shared files, read back at scrape, so they are
        # kept out of the rendered registry (it would show this process's share besides the sum).
        r = CollectorRegistry() if multiprocess_dir else self.registry
        lbl = ["model_name", "engine"]

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, lbl, registry=r)

        def hist(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(name, doc, lbl, buckets=buckets, registry=r)

        families = {
            "prompt_tokens": counter("vllm:prompt_tokens", "Number of prefill tokens processed."),
            "generation_tokens": counter("vllm:generation_tokens", "Number of generation tokens processed."),
            "ttft": hist("vllm:time_to_first_token_seconds", "Time to first token in seconds.", _TTFT_BUCKETS),
            "itl": hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        _TPOT_BUCKETS),
            "tpot": hist("vllm:time_per_output_token_seconds", "Time per output token in seconds (the older name of "
                         "inter_token_latency_seconds).", _TPOT_BUCKETS),
            "e2e": hist("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", _E2E_BUCKETS),
            "queue": hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                          _E2E_BUCKETS),
            "prefill": hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                            "request.", _E2E_BUCKETS),
            "decode": hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                           _E2E_BUCKETS),
            "inference": hist("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for "
                              "request.", _E2E_BUCKETS),
            "req_tpot": hist("vllm:request_time_per_output_token_seconds",
                             "Histogram of time_per_output_token_seconds per request.", _TPOT_BUCKETS),
            "req_prompt": hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOKEN_BUCKETS),
            "req_gen": hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                            _TOKEN_BUCKETS),
            "iteration_tokens": hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     _ITERATION_TOKEN_BUCKETS),
            "req_n": hist("vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS),
            "_success_family": Counter("vllm:request_success", "Count of finished requests by finish reason.",
                                       ["model_name", "finished_reason", "engine"], registry=r),
        }
        self.engines = [_EngineChildren(families, model_name, str(i)) for i in range(num_engines)]
        self._families_registry, self._hist = r, hist
        # Built by engine_ready (their buckets go up to max_model_len, as vLLM's): families and their children.
        self._by_len: Optional[dict[str, Any]] = None
        self._cache_config: dict[int, dict[str, str]] = {}  # engine core -> vllm:cache_config_info's labels
        self.api_server_requests = Counter(
            "pagedllm:api_server_requests", "HTTP requests (health probes and scrapes aside) taken by each API "
            "server process.", ["model_name", "api_server"], registry=r).labels(model_name, str(api_server))
        self._stats: list[Any] = [None] * num_engines  # the latest SchedulerStats of each engine core
        self._stats_time = [time.time()] * num_engines
        self.lora_info = False  # vllm:lora_requests_info, with enable_lora (enable_lora_info)
        self._merged: Optional[CollectorRegistry] = None  # view() with several API processes
        self.registry.register(_EngineCollector(self))

    def enable_lora_info(self, max_loras: int, names_by_id: dict) -> None:
        """vLLM's `vllm:lora_requests_info`: per engine core, one sample whose labels name the running and waiting
        adapters and whose value is the time of the update. `names_by_id` maps engine adapter ids to served names."""
        self._max_loras = str(max_loras)
        self._lora_names = names_by_id
        self.lora_info = True

    def engine_ready(self, engine: int, max_model_len: int, cache_config: dict[str, str]) -> None:
        """What an engine core said when it was ready: its context length (the buckets of the max_tokens
        histograms) and its cache config (vllm:cache_config_info's labels)."""
        self._cache_config[engine] = dict(cache_config)
        if self._by_len is not None:
            return
        buckets = buckets_1_2_5(max_model_len)
        self._by_len = {
            "max_tokens": self._hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request "
                                     "parameter.", buckets),
            "max_gen": self._hist("vllm:request_max_num_generation_tokens", "Histogram of maximum number of "
                                  "requested generation tokens.", buckets),
        }
        for i, e in enumerate(self.engines):
            e.req_max_tokens = self._by_len["max_tokens"].labels(self.model_name, str(i))
            e.req_max_gen = self._by_len["max_gen"].labels(self.model_name, str(i))

    # ---- recorders ------------------------------------------------------------------------------

    def update_scheduler_stats(self, stats: Any, prev: Any = None, engine: int = 0) -> None:
        """The engine core's latest gauges and totals (rendered at the next scrape)."""
        self._stats[engine] = stats
        self._stats_time[engine] = time.time()

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int, engine: int = 0) -> None:
        self.engines[engine].ttft.observe(ttft_s)
        self.engines[engine].prompt_tokens.inc(num_prompt_tokens)

    def add_generation_tokens(self, n: int, engine: int = 0) -> None:
        self.engines[engine].generation_tokens.inc(n)

    def observe_gaps(self, gaps: list[float], engine: int = 0) -> None:
        """The gaps since each request's previous output, for the requests of one engine step that had had one
        (vLLM's per-iteration inter-token latency): vllm:inter_token_latency_seconds and its older name
        time_per_output_token_seconds, one sample per gap, recorded in bulk (`_observe_all`)."""
        e = self.engines[engine]
        _observe_all((e.itl, e.tpot), gaps)

    def observe_iteration_tokens(self, n: int, engine: int = 0) -> None:
        """One engine step's tokens, as vLLM counts them: the prompts of the requests whose first token it brought
        plus the tokens it generated."""
        self.engines[engine].iteration_tokens.observe(n)

    def observe_finished(self, reason: str, e2e_s: float, tpot_s: Optional[float], engine: int = 0,
                         num_prompt: Optional[int] = None, num_generated: Optional[int] = None,
                         phases: Optional[tuple[float, float, float]] = None, max_tokens: Optional[int] = None,
                         samples: Optional[tuple[int, int]] = None) -> None:
        """A finished (engine) request. tpot_s, its mean time per output token after the first, goes to
        vllm:request_time_per_output_token_seconds; `phases` (a request that was scheduled and produced a token):
        its queue, prefill and decode seconds (inference = prefill + decode); `max_tokens`: its max_tokens
        parameter (resolved: the room left by the prompt when unset). `samples`, (n, most tokens generated by one
        of them), comes once per user request, with its last sample to finish."""
        e = self.engines[engine]
        if max_tokens and e.req_max_tokens is not None:
            e.req_max_tokens.observe(max_tokens)
        if samples is not None:
            e.req_n.observe(samples[0])
            if e.req_max_gen is not None:
                e.req_max_gen.observe(samples[1])
        if phases is not None:
            queue, prefill, decode = phases
            e.queue.observe(queue)
            e.prefill.observe(prefill)
            e.decode.observe(decode)
            e.inference.observe(prefill + decode)
        e.success_child(reason).inc()
        e.e2e.observe(e2e_s)
        if tpot_s is not None:
            e.req_tpot.observe(tpot_s)
        if num_prompt is not None:
            e.req_prompt.observe(num_prompt)
        if num_generated is not None:
            e.req_gen.observe(num_generated)

    def view(self) -> CollectorRegistry:
        """What /metrics shows, as a registry to collect() from: with several API processes, the sums over them
        (read from the multiprocess files at each collect) and this process's collectors."""
        if self.multiprocess_dir is None:
            return self.registry
        if self._merged is None:
            from prometheus_client.multiprocess import MultiProcessCollector

            self._merged = CollectorRegistry()
            MultiProcessCollector(self._merged, path=self.multiprocess_dir)
            self._merged.register(_RegistryView(self.registry))
        return self._merged

    def render(self) -> bytes:
        return generate_latest(self.view())


def _observe_all(children: tuple, values: list[float]) -> None:
    """`child.observe(v)` for each value and each of the histogram children (of the same buckets), as one increment
    per bucket hit and one of the sum: every step brings a gap per running request, and observe() takes two locks
    a value in the API process's hot path. Falls back to observe() where prometheus_client's histogram child is not
    laid out as this expects."""
    if not values:
        return
    hits: Optional[dict[int, int]] = None
    for child in children:
        bounds, buckets, total = (getattr(child, name, None) for name in ("_upper_bounds", "_buckets", "_sum"))
        if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
            for value in values:
                child.observe(value)
            continue
        if hits is None:
            hits = {}
            for value in values:
                i = bisect_left(bounds, value)  # the first bucket whose bound is >= value, as observe() picks
                hits[i] = hits.get(i, 0) + 1
        total.inc(sum(values))
        for i, n in hits.items():
            buckets[i].inc(n)


class _RegistryView:
    """Another registry's metrics, as one collector."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Any:
        return self.registry.collect()


class _EngineCollector:
    """The engine cores' gauges and running totals from their latest SchedulerStats, at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Any:
        m = self.metrics
        engines = [(str(i), s) for i, s in enumerate(m._stats)]
        for name, doc, field in _ENGINE_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
            for engine, stats in engines:
                family.add_metric([m.model_name, engine], float(getattr(stats, field, 0) if stats else 0))
            yield family
        for name, doc, field in _ENGINE_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
            for engine, stats in engines:
                family.add_metric([m.model_name, engine], float(getattr(stats, field, 0) if stats else 0))
            yield family
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=["model_name", "position", "engine"])
        for engine, stats in engines:
            # every position, zeros too (vLLM creates one per speculative token): LLM.get_metrics()'s Vector has
            # num_speculative_tokens values
            for pos, count in enumerate(getattr(stats, "spec_num_accepted_tokens_per_pos", ()) if stats else ()):
                per_pos.add_metric([m.model_name, str(pos), engine], float(count))
        yield per_pos
        yield self._sleep_state(engines)
        if m._cache_config:
            yield self._cache_config_info()
        if m.lora_info:
            yield self._lora_info(engines)

    def _sleep_state(self, engines: list) -> Any:
        """vLLM's vllm:engine_sleep_state: per engine core, 1 on the state it is in (awake; weights_offloaded: sleep
        level 1; discard_all: level 2), 0 on the others; all 0 while only the KV cache sleeps (the weights woken
        first: neither awake nor the weights away). From the latest stats, so any API process shows every core's."""
        m = self.metrics
        family = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state: 1 on the engine's state, awake "
                                   "(serving), weights_offloaded (sleep level 1) or discard_all (sleep level 2).",
                                   labels=["model_name", "engine", "sleep_state"])
        for engine, stats in engines:
            state = getattr(stats, "sleep_state", "awake") if stats else "awake"
            for name in SLEEP_STATES:
                family.add_metric([m.model_name, engine, name], float(state == name))
        return family

    def _cache_config_info(self) -> Any:
        """vLLM's info-style gauge: value 1, the engine core's cache config in the labels (no model_name, as
        vLLM)."""
        configs = self.metrics._cache_config
        keys = sorted({k for c in configs.values() for k in c})
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=keys + ["engine"])
        for engine, config in sorted(configs.items()):
            family.add_metric([config.get(k, "") for k in keys] + [str(engine)], 1.0)
        return family

    def _lora_info(self, engines: list) -> Any:
        m = self.metrics

        def names(ids: Any) -> str:
            return ",".join(m._lora_names.get(i, str(i)) for i in ids)

        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters", "engine"])
        for i, (engine, stats) in enumerate(engines):
            family.add_metric([m._max_loras, names(getattr(stats, "running_lora_ids", ())),
                               names(getattr(stats, "waiting_lora_ids", ())), engine], m._stats_time[i])
        return family
