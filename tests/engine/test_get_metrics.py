"""LLM.get_metrics() (vLLM's offline metrics API) on the real SmolLM2 GGUF: exact token and request counts after
requests of known lengths, the spec-decode per-position Vector, and the refusal without stats."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.metrics.reader import Counter, Gauge, Histogram, Vector, get_metrics_snapshot

COMMON = dict(max_model_len=512, kv_cache_memory_bytes=1 << 26)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
REPEAT = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank. "
          "The quick brown fox jumps over")


@pytest.fixture(scope="module")
def llm(smollm2_gguf_path):
    with LLM(smollm2_gguf_path, disable_log_stats=False, **COMMON) as llm:
        yield llm


def one(metrics: list, name: str, kind: type, **labels: str):
    """The single series of `name` whose labels include `labels`."""
    found = [m for m in metrics if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    assert isinstance(found[0], kind)
    return found[0]


def deltas(before: list, after: list) -> dict:
    """Counter values and histogram (count, sum) by (name, labels): after - before (the module's LLM is shared)."""
    def values(metrics):
        out = {}
        for m in metrics:
            key = (m.name, tuple(sorted(m.labels.items())))
            out[key] = (m.count, m.sum) if isinstance(m, Histogram) else getattr(m, "value", None)
        return out
    b, a = values(before), values(after)
    return {k: (v[0] - b[k][0], v[1] - b[k][1]) if isinstance(v, tuple) else (v - b[k] if v is not None else None)
            for k, v in a.items() if k in b}


def total(d: dict, name: str, **labels: str):
    hits = [v for (n, lbl), v in d.items() if n == name and all(dict(lbl).get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels)
    return hits[0]


def test_counts_of_known_requests(llm):
    """N token prompts of known lengths, max_tokens known (ignore_eos: every one ends "length" at exactly that),
    plus one greedy request stopped by its own first token ("stop", one token): exact counters and histogram
    counts = N."""
    # greedy's first token for this prompt, so that a stop_token_ids request ends "stop" after exactly one token
    stop_prompt = [1, 504, 3458, 314, 4849, 314]
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    first = llm.generate([{"prompt_token_ids": stop_prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids[0]

    before = llm.get_metrics()
    prompts = [list(range(100, 100 + n)) for n in (3, 7, 12)]
    lengths = [2, 5, 4]
    params = [SamplingParams(max_tokens=k, ignore_eos=True, temperature=0.0) for k in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    stop = llm.generate([{"prompt_token_ids": stop_prompt}],
                        SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first]), use_tqdm=False)[0]
    assert stop.outputs[0].finish_reason == "stop" and len(stop.outputs[0].token_ids) == 1
    after = llm.get_metrics()
    d = deltas(before, after)

    n = len(prompts) + 1
    num_prompt = sum(map(len, prompts)) + len(stop_prompt)
    num_generated = sum(lengths) + 1
    assert total(d, "vllm:prompt_tokens") == num_prompt
    assert total(d, "vllm:generation_tokens") == num_generated
    assert total(d, "vllm:request_success", finished_reason="length") == 3
    assert total(d, "vllm:request_success", finished_reason="stop") == 1
    assert total(d, "vllm:request_success", finished_reason="abort") == 0
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_params_n"):
        assert total(d, name)[0] == n, name
    assert total(d, "vllm:request_prompt_tokens") == (n, num_prompt)
    assert total(d, "vllm:request_generation_tokens") == (n, num_generated)
    # one inter-token gap per token after each request's first
    assert total(d, "vllm:inter_token_latency_seconds")[0] == num_generated - n
    # every prompt token was looked up in the prefix cache once
    assert total(d, "vllm:prefix_cache_queries") == num_prompt

    hist = one(after, "vllm:e2e_request_latency_seconds", Histogram)
    assert hist.buckets["+Inf"] == hist.count and list(hist.buckets.values()) == sorted(hist.buckets.values())
    # idle again: nothing running or waiting, no block held
    assert one(after, "vllm:num_requests_running", Gauge).value == 0
    assert one(after, "vllm:num_requests_waiting", Gauge).value == 0
    assert one(after, "vllm:kv_cache_usage_perc", Gauge).value == 0.0
    # no pagedllm: family, and counters named without prometheus_client's _total (vLLM's reader)
    assert all(m.name.startswith("vllm:") for m in after)
    assert not [m.name for m in after if isinstance(m, Counter) and m.name.endswith("_total")]


def test_request_success_has_every_reason_and_prefix_hits(llm):
    """vllm:request_success has vLLM's five finish reasons; a prompt run twice hits the prefix cache."""
    reasons = {m.labels["finished_reason"] for m in llm.get_metrics() if m.name == "vllm:request_success"}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    prompt = {"prompt_token_ids": list(range(200, 240))}  # 40 tokens: two full blocks of 16 to share
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt], params, use_tqdm=False)
    before = llm.get_metrics()
    llm.generate([prompt], params, use_tqdm=False)
    d = deltas(before, llm.get_metrics())
    assert total(d, "vllm:prefix_cache_queries") == 40
    assert total(d, "vllm:prefix_cache_hits") == 32


def test_stop_string_and_error_reasons(llm):
    """A stop string found by the detokenizer (the engine aborts the request) counts "stop", as the server counts
    it; a request the engine fails (its masks leave no token) counts "error"."""
    prompt = {"prompt_token_ids": [1, 504, 3458, 314]}
    greedy = dict(temperature=0.0, ignore_eos=True)
    text = llm.generate([prompt], SamplingParams(max_tokens=6, **greedy), use_tqdm=False)[0].outputs[0].text
    before = llm.get_metrics()
    outs = llm.generate([prompt, prompt], [
        SamplingParams(max_tokens=20, stop=[text], **greedy),
        SamplingParams(max_tokens=8, allowed_token_ids=[40], stop_token_ids=[40], min_tokens=3, temperature=0.0)],
        use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["stop", "error"]
    d = deltas(before, llm.get_metrics())
    assert {r: total(d, "vllm:request_success", finished_reason=r) for r in ("stop", "error", "abort", "length")} == {
        "stop": 1, "error": 1, "abort": 0, "length": 0}
    assert total(d, "vllm:e2e_request_latency_seconds")[0] == 2


def test_spec_decode_vector(smollm2_gguf_path):
    """ngram speculation: the accepted tokens per draft position come as one Vector of num_speculative_tokens
    values, summing to the accepted tokens counter; a later position is accepted only after the earlier ones."""
    with LLM(smollm2_gguf_path, disable_log_stats=False, speculative_config=NGRAM, **COMMON) as llm:
        out = llm.generate([REPEAT], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
        metrics = llm.get_metrics()
    vector = one(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos", Vector)
    accepted = one(metrics, "vllm:spec_decode_num_accepted_tokens", Counter).value
    assert len(vector.values) == NGRAM["num_speculative_tokens"]
    assert sum(vector.values) == accepted > 0
    assert vector.values == sorted(vector.values, reverse=True)
    assert one(metrics, "vllm:spec_decode_num_drafts", Counter).value > 0
    assert one(metrics, "vllm:spec_decode_num_draft_tokens", Counter).value >= accepted
    assert one(metrics, "vllm:generation_tokens", Counter).value == len(out.outputs[0].token_ids)


def test_stats_disabled(smollm2_gguf_path):
    """The offline default (disable_log_stats=True, as vLLM's LLM): get_metrics() fails as vLLM's does."""
    with LLM(smollm2_gguf_path, **COMMON) as llm:
        llm.generate(["Hi"], SamplingParams(max_tokens=1), use_tqdm=False)
        with pytest.raises(AssertionError, match="Stat logging disabled"):
            llm.get_metrics()


def test_reader_of_a_registry():
    """get_metrics_snapshot on a hand-built registry: vllm: families only, _total dropped, cumulative buckets by
    upper bound, per-position counters folded into a Vector (missing positions 0)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as PCounter
    from prometheus_client import Gauge as PGauge
    from prometheus_client import Histogram as PHistogram

    r = CollectorRegistry()
    PCounter("vllm:prompt_tokens", "", ["engine"], registry=r).labels("0").inc(5)
    PCounter("pagedllm:other", "", registry=r).inc()
    PGauge("vllm:num_requests_running", "", registry=r).set(2)
    h = PHistogram("vllm:e2e_request_latency_seconds", "", buckets=(1.0, 2.0), registry=r)
    for v in (0.5, 1.5, 3.0):
        h.observe(v)
    pos = PCounter("vllm:spec_decode_num_accepted_tokens_per_pos", "", ["position"], registry=r)
    pos.labels("0").inc(4)
    pos.labels("2").inc(1)
    snap = get_metrics_snapshot(r)
    assert [m.name for m in snap if m.name.startswith("pagedllm")] == []
    assert Counter("vllm:prompt_tokens", {"engine": "0"}, 5) in snap
    assert Gauge("vllm:num_requests_running", {}, 2.0) in snap
    assert Histogram("vllm:e2e_request_latency_seconds", {}, 3, 5.0, {"1.0": 1, "2.0": 2, "+Inf": 3}) in snap
    assert Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {}, [4, 0, 1]) in snap
