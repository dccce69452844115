"""Prometheus metrics with vLLM's names (so existing Grafana dashboards work), labelled by model_name.

Lives in the API process. Gauges and the engine's cumulative counters (preemptions, prefix cache) are
refreshed from the SchedulerStats the engine core sends; token counters and latency histograms are
recorded by AsyncEngine as outputs arrive.
"""
from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the /metrics route
from prometheus_client import disable_created_metrics

disable_created_metrics()  # the *_created series only add noise for dashboards

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class Metrics:
    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r, lbl = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, lbl, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, lbl, registry=r).labels(model_name)

        def hist(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(name, doc, lbl, buckets=buckets, registry=r).labels(model_name)

        self.num_running = gauge("vllm:num_requests_running", "Number of requests in the running batch.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_usage = gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (older name of kv_cache_usage_perc).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.")
        success = Counter(
            "vllm:request_success", "Count of finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=r,
        )
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success_family = success
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token in seconds.", _TTFT_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Time per output token in seconds.", _TPOT_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", _E2E_BUCKETS)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._spec_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            ["model_name", "position"], registry=r,
        )

        self.lora_info: Any = None  # vllm:lora_requests_info, with enable_lora (enable_lora_info)

    def enable_lora_info(self, max_loras: int, names_by_id: dict) -> None:
        """vLLM's `vllm:lora_requests_info`: one sample whose labels name the running and waiting adapters and
        whose value is the time of the update. `names_by_id` maps engine adapter ids to served names."""
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                               ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=self.registry)
        self._max_loras = str(max_loras)
        self._lora_names = names_by_id
        self.lora_info.labels(self._max_loras, "", "").set_to_current_time()

    def _update_lora_info(self, stats: Any) -> None:
        def names(ids: Any) -> str:
            return ",".join(self._lora_names.get(i, str(i)) for i in ids)

        self.lora_info.clear()  # only the current combination is exported
        self.lora_info.labels(self._max_loras, names(getattr(stats, "running_lora_ids", ())),
                              names(getattr(stats, "waiting_lora_ids", ()))).set_to_current_time()

    # ---- recorders ------------------------------------------------------------------------------

    def update_scheduler_stats(self, stats: Any, prev: Any) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.gpu_usage.set(stats.kv_cache_usage)
        if self.lora_info is not None:
            self._update_lora_info(stats)
        # The engine reports cumulative counts; counters only move forward by the difference.
        for counter, now, before in (
            (self.preemptions, stats.num_preemptions, prev.num_preemptions),
            (self.prefix_queries, stats.prefix_cache_queries, prev.prefix_cache_queries),
            (self.prefix_hits, stats.prefix_cache_hits, prev.prefix_cache_hits),
        ):
            if now > before:
                counter.inc(now - before)
        self._update_spec_decode(stats, prev)

    def _update_spec_decode(self, stats: Any, prev: Any) -> None:
        for counter, name in ((self.spec_drafts, "spec_num_drafts"), (self.spec_draft_tokens, "spec_num_draft_tokens"),
                              (self.spec_accepted_tokens, "spec_num_accepted_tokens")):
            now, before = getattr(stats, name, 0), getattr(prev, name, 0)
            if now > before:
                counter.inc(now - before)
        now_pos = getattr(stats, "spec_num_accepted_tokens_per_pos", ())
        before_pos = getattr(prev, "spec_num_accepted_tokens_per_pos", ())
        for pos, now in enumerate(now_pos):
            before = before_pos[pos] if pos < len(before_pos) else 0
            if now > before:
                self._spec_per_pos.labels(self.model_name, str(pos)).inc(now - before)

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def add_generation_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def observe_finished(self, reason: str, e2e_s: float, tpot_s: Optional[float]) -> None:
        child = self.success.get(reason)
        if child is None:
            child = self.success[reason] = self._success_family.labels(self.model_name, reason)
        child.inc()
        self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
