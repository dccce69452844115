"""Under load: 32 concurrent streams equal the offline engine; disconnects free KV at once; metrics move."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

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
             "vllm:e2e_request_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
             "vllm:prefix_cache_queries_total"]
    before_text = _metrics(server)
    before = {n: metric(before_text, n, model_name=SERVED_NAME) for n in names}
    length_before = metric(before_text, "vllm:request_success_total", finished_reason="length")
    r = http.post("/v1/completions", json={"prompt": "Metrics test prompt", "max_tokens": 7, "ignore_eos": True})
    usage = r.json()["usage"]
    after_text = _metrics(server)
    after = {n: metric(after_text, n, model_name=SERVED_NAME) for n in names}
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 7
    for n in names[2:5]:
        assert after[n] == before[n] + 1, n
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert metric(after_text, "vllm:request_success_total", finished_reason="length") == length_before + 1
    for name in ("vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total"):
        assert f"{name}{{" in after_text
    assert 'model_name="smol"' in after_text
