"""Under load: 32 concurrent streams equal the offline engine; disconnects free KV at once; metrics move."""
from __future__ import annotations

import asyncio
import json
import time

import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e_helpers import API_KEY, SERVED_NAME, Server, metric

NUM_CONCURRENT = 32
MAX_TOKENS = 16
PROMPTS = [f"Question {i}: name one fact about the number {i * 7 + 3}. Answer:" for i in range(NUM_CONCURRENT)]


async def _stream_one(client: httpx.AsyncClient, prompt: str) -> tuple[str, int, float]:
    pieces, first = [], None
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json={
            "model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        usage = None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"]:
                if first is None:
                    first = time.perf_counter() - start
                pieces.append(chunk["choices"][0]["text"])
    return "".join(pieces), usage["completion_tokens"], first


def test_32_concurrent_streams_equal_offline_engine(server: Server, offline_llm) -> None:
    async def run_all() -> list:
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=300, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(_stream_one(client, p) for p in PROMPTS))

    results = asyncio.run(run_all())
    texts = [r[0] for r in results]
    assert all(r[1] > 0 for r in results)

    from pagedllm import SamplingParams

    offline = offline_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    expected = [o.outputs[0].text for o in offline]
    mismatches = [(i, texts[i], expected[i]) for i in range(NUM_CONCURRENT) if texts[i] != expected[i]]
    assert not mismatches, mismatches[:3]
    assert [r[1] for r in results] == [len(o.outputs[0].token_ids) for o in offline]


def _metrics(server: Server) -> str:
    return httpx.get(server.url + "/metrics", timeout=30).text


def test_disconnect_mid_stream_frees_kv(server: Server) -> None:
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "Tell me a very long story.", "max_tokens": 800,
                                                       "ignore_eos": True, "stream": True}) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                if got == 5:
                    # still inside the stream (leaving iter_lines early closes the connection)
                    during = _metrics(server)
                    break
            assert metric(during, "vllm:num_requests_running", model_name=SERVED_NAME) == 1
            assert metric(during, "vllm:kv_cache_usage_perc", model_name=SERVED_NAME) > 0
    # the connection is closed mid-stream: the request must be aborted and its blocks freed
    deadline = time.monotonic() + 60  # a hang guard
    while True:
        after = _metrics(server)
        usage = metric(after, "vllm:kv_cache_usage_perc", model_name=SERVED_NAME)
        running = metric(after, "vllm:num_requests_running", model_name=SERVED_NAME)
        if (usage, running) == (0.0, 0.0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (usage, running) == (0.0, 0.0)
    assert metric(after, "vllm:gpu_cache_usage_perc", model_name=SERVED_NAME) == 0.0
    assert metric(after, "vllm:request_success_total", finished_reason="abort") >= 1


def test_metrics_move(server: Server, http: httpx.Client) -> None:
    names = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
             "vllm:e2e_request_latency_seconds_count", "vllm:request_time_per_output_token_seconds_count",
             "vllm:prefix_cache_queries_total", "vllm:time_per_output_token_seconds_count",
             "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum",
             "vllm:request_generation_tokens_count", "vllm:inter_token_latency_seconds_count",
             # vLLM's request phase histograms (were missing): one sample each per finished request
             "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
             "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
             "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
             "vllm:request_inference_time_seconds_sum", "vllm:e2e_request_latency_seconds_sum",
             "vllm:request_queue_time_seconds_sum"]
    # vLLM's per-step token histogram and request-parameter histograms (were missing)
    extra = [("vllm:iteration_tokens_total_" + s, {}) for s in ("sum", "count")]
    extra += [("vllm:iteration_tokens_total_bucket", {"le": "1.0"})]
    extra += [(f"vllm:{h}_{s}", {}) for h in ("request_params_n", "request_params_max_tokens",
                                                "request_max_num_generation_tokens") for s in ("sum", "count")]
    extra += [("vllm:request_params_n_bucket", {"le": le}) for le in ("1.0", "2.0")]
    before_text = _metrics(server)
    before = {n: metric(before_text, n, model_name=SERVED_NAME) for n in names}
    before.update({(n, tuple(lbl.items())): metric(before_text, n, model_name=SERVED_NAME, **lbl) for n, lbl in extra})
    length_before = metric(before_text, "vllm:request_success_total", finished_reason="length")
    r = http.post("/v1/completions", json={"prompt": "Metrics test prompt", "max_tokens": 7, "ignore_eos": True})
    usage = r.json()["usage"]
    after_text = _metrics(server)
    after = {n: metric(after_text, n, model_name=SERVED_NAME) for n in names}
    after.update({(n, tuple(lbl.items())): metric(after_text, n, model_name=SERVED_NAME, **lbl) for n, lbl in extra})
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 7
    for n in names[2:5]:
        assert after[n] == before[n] + 1, n
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    # one inter-token gap per step that brought the request tokens after its first (7 tokens: 1 to 6 steps)
    gaps = after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"]
    assert 1 <= gaps <= 6
    assert after["vllm:time_per_output_token_seconds_count"] - before["vllm:time_per_output_token_seconds_count"] == gaps
    assert after["vllm:request_prompt_tokens_sum"] - before["vllm:request_prompt_tokens_sum"] == usage["prompt_tokens"]
    assert after["vllm:request_generation_tokens_sum"] - before["vllm:request_generation_tokens_sum"] == 7
    assert after["vllm:request_generation_tokens_count"] == before["vllm:request_generation_tokens_count"] + 1
    assert metric(after_text, "vllm:request_success_total", finished_reason="length") == length_before + 1
    delta = {n: after[n] - before[n] for n in names}
    assert [delta[n] for n in names[11:15]] == [1, 1, 1, 1]
    prefill, decode, inference, e2e, queue = (delta[n] for n in names[15:])
    assert inference == pytest.approx(prefill + decode) and 0 < decode and inference <= e2e
    assert 0 < queue < e2e  # (a wall-clock arrival against the scheduler's monotonic clock gave 0)
    for name in ("vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total"):
        assert f"{name}{{" in after_text
    assert 'model_name="smol"' in after_text
    d = {k[0] + "".join(f"{{{a}={b}}}" for a, b in k[1]): after[k] - before[k] for k in after if isinstance(k, tuple)}
    # vLLM counts a step's tokens as the prompts of the requests whose first token it brought plus the tokens it
    # generated: the first step has prompt + 1, each later one 1 (nothing else runs)
    steps = d["vllm:iteration_tokens_total_count"]
    assert d["vllm:iteration_tokens_total_sum"] == usage["prompt_tokens"] + 7 and 1 <= steps <= 7
    assert d["vllm:iteration_tokens_total_bucket{le=1.0}"] == steps - 1
    assert (d["vllm:request_params_n_count"], d["vllm:request_params_n_sum"]) == (1, 1)
    assert (d["vllm:request_params_max_tokens_count"], d["vllm:request_params_max_tokens_sum"]) == (1, 7)
    assert d["vllm:request_max_num_generation_tokens_sum"] == 7

    # n = 2: n once per request, max_tokens once per sample (as vLLM), the longest sample's tokens once
    r = http.post("/v1/completions", json={"prompt": "Metrics test prompt", "max_tokens": 3, "n": 2, "seed": 1,
                                           "ignore_eos": True, "temperature": 0.8})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    again_text = _metrics(server)
    again = {(n, tuple(lbl.items())): metric(again_text, n, model_name=SERVED_NAME, **lbl) for n, lbl in extra}
    d = {k[0] + "".join(f"{{{a}={b}}}" for a, b in k[1]): again[k] - after[k] for k in again}
    assert (d["vllm:request_params_n_count"], d["vllm:request_params_n_sum"]) == (1, 2)
    assert (d["vllm:request_params_n_bucket{le=1.0}"], d["vllm:request_params_n_bucket{le=2.0}"]) == (0, 1)
    assert (d["vllm:request_params_max_tokens_count"], d["vllm:request_params_max_tokens_sum"]) == (2, 6)
    assert (d["vllm:request_max_num_generation_tokens_count"], d["vllm:request_max_num_generation_tokens_sum"]) \
        == (1, 3)
    assert d["vllm:iteration_tokens_total_sum"] == 2 * r.json()["usage"]["prompt_tokens"] + 6


def test_cache_config_info(server: Server) -> None:
    """vllm:cache_config_info: vLLM's info-style gauge, 1 with the cache config as labels, once per engine core
    (also with several API processes); num_gpu_blocks is the engine's own count, as its start-up log says."""
    families = {f.name: f for f in text_string_to_metric_families(_metrics(server))}
    samples = families["vllm:cache_config_info"].samples
    assert len(samples) == 1 and samples[0].value == 1.0
    labels = samples[0].labels
    logged = re.search(r"Engine ready in [\d.]+ s: (\d+) KV blocks of (\d+) tokens", server.log())
    assert logged is not None
    assert labels["num_gpu_blocks"] == logged.group(1) and labels["block_size"] == logged.group(2) == "16"
    assert {k: labels[k] for k in ("cache_dtype", "enable_prefix_caching", "kv_cache_memory_bytes",
                                   "gpu_memory_utilization", "num_gpu_blocks_override", "engine")} == {
        "cache_dtype": "auto", "enable_prefix_caching": "True", "kv_cache_memory_bytes": str(256 << 20),
        "gpu_memory_utilization": "0.9", "num_gpu_blocks_override": "None", "engine": "0"}


CHUNK_STREAMS = 12
CHUNK_TOKENS = 24


async def _tokens_per_chunk_raw(client: httpx.AsyncClient, i: int, chat: bool) -> list[int]:
    """Tokens each chunk of one raw-HTTP stream carried (the difference of its continuous usage to the one before)."""
    body = {"model": SERVED_NAME, "max_tokens": CHUNK_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPTS[i]}]
    else:
        body["prompt"] = PROMPTS[i]
    counts, seen = [], 0
    async with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                done = chunk["usage"]["completion_tokens"]
                if done > seen:
                    counts.append(done - seen)
                    seen = done
    return counts


async def _tokens_per_chunk_sdk(client, i: int) -> list[int]:
    """The same through the openai SDK's streaming chat (continuous_usage_stats is vLLM's, passed through)."""
    stream = await client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=CHUNK_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True})
    counts, seen = [], 0
    async for chunk in stream:
        if chunk.choices and chunk.usage is not None and chunk.usage.completion_tokens > seen:
            counts.append(chunk.usage.completion_tokens - seen)
            seen = chunk.usage.completion_tokens
    return counts


def test_concurrent_streams_come_a_token_or_two_per_chunk(server: Server) -> None:
    """Streams stream: with CHUNK_STREAMS streams at once (completions and chat over raw HTTP, chat through the
    openai SDK), every stream gets all its tokens in chunks of one or two tokens, never in lumps. Each engine step's
    output is its own chunk even when the API process writes several at once, so this holds however busy the
    machine is (counts, not times)."""
    import openai

    async def run_all() -> list[list[int]]:
        sdk = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300)
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=300, limits=httpx.Limits(max_connections=64)) as client:
            jobs = []
            for i in range(CHUNK_STREAMS):
                kind = i % 3
                jobs.append(_tokens_per_chunk_sdk(sdk, i) if kind == 2 else
                            _tokens_per_chunk_raw(client, i, chat=kind == 1))
            try:
                return await asyncio.gather(*jobs)
            finally:
                await sdk.close()

    per_stream = asyncio.run(run_all())
    assert [sum(c) for c in per_stream] == [CHUNK_TOKENS] * CHUNK_STREAMS
    every = [n for counts in per_stream for n in counts]
    assert max(every) <= 2, per_stream
    assert len(every) >= 0.9 * CHUNK_STREAMS * CHUNK_TOKENS, per_stream  # nearly one chunk per token


def test_stop_string_on_the_last_token_counts_as_stop(server: Server, http: httpx.Client) -> None:
    """A stop string completed by the token that also reaches max_tokens: the client's finish_reason is "stop",
    and so is vllm:request_success's (as vLLM's; it counted "length")."""
    body = {"prompt": "1, 2, 3,", "temperature": 0, "stop": [" 6"]}
    first = http.post("/v1/completions", json={**body, "max_tokens": 20}).json()
    assert first["choices"][0]["finish_reason"] == "stop"
    k = first["usage"]["completion_tokens"]  # the stop string ends on the k-th token
    before = _metrics(server)
    r = http.post("/v1/completions", json={**body, "max_tokens": k}).json()
    after = _metrics(server)
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (first["choices"][0]["text"], "stop")

    def delta(reason: str) -> float:
        return (metric(after, "vllm:request_success_total", finished_reason=reason)
                - metric(before, "vllm:request_success_total", finished_reason=reason))

    assert (delta("stop"), delta("length")) == (1, 0)


def test_failed_step_counts_as_error(server: Server, http: httpx.Client) -> None:
    """A request a step fails (its constraints leave no token: a 400 after it was scheduled) is a finished request
    to the metrics, finished_reason="error" as vLLM's, with its e2e latency; a running sibling of an n=2 request
    that the failure ends counts as "abort" (both were dropped: request_success never showed an "error")."""
    (t,) = http.post("/tokenize", json={"model": SERVED_NAME, "prompt": " one",
                                        "add_special_tokens": False}).json()["tokens"][:1]
    body = {"prompt": "Count: one, two,", "max_tokens": 4, "allowed_token_ids": [t], "stop_token_ids": [t],
            "min_tokens": 2}
    reasons = ("error", "abort", "stop", "length")

    def counts(text: str) -> list[float]:
        return [metric(text, "vllm:request_success_total", finished_reason=r) for r in reasons] + [
            metric(text, "vllm:e2e_request_latency_seconds_count"), metric(text, "vllm:request_params_n_count")]

    before = counts(_metrics(server))
    for extra in ({}, {"stream": True}, {"n": 2, "temperature": 0.8, "seed": 3}):
        r = http.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 400 and "no token satisfies" in r.json()["error"]["message"], r.text
    after = counts(_metrics(server))
    error, abort, stop, length, e2e, n = (a - b for a, b in zip(after, before))
    # the n=2 request's children fail in one step: the first is "error", the other "error" or "abort"
    assert (error + abort, stop, length, e2e, n) == (4, 0, 0, 4, 3) and error >= 3
