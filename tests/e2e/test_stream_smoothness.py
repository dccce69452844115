"""Streaming under many concurrent streams, against the real server (a tiny random Qwen3 with its tokenizer):
every stream gets every token, in order, with the same text as the request without streaming; and a stream is
sent while it is generated, not at the end of its request (a hang-up after the first chunk aborts it), one token per
chunk. Counts and order only: how evenly the chunks come depends on the machine and is measured by benchmarks/stream_smoothness.py
(the client used here), whose numbers docs/benchmarks.md reports."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import httpx
import pytest

from e2e_helpers import metric, serving


sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from stream_smoothness import measure  # noqa: E402

STREAMS, TOKENS = 64, 128


@pytest.fixture(scope="module")
def tiny_server(tiny_qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory):
    flags = ["--served-model-name", "m", "--max-num-seqs", str(STREAMS), "--max-model-len", "256", "--dtype", "float32",
             "--kv-cache-memory-bytes", str(64 << 20), "--disable-uvicorn-access-log"]
    with serving(tiny_qwen3_dir, flags, str(tmp_path_factory.mktemp("stream") / "server.log")) as url:
        yield url


def test_concurrent_streams_get_every_token_in_order(tiny_server: str):
    ref = httpx.post(tiny_server + "/v1/completions", timeout=120, json={
        "model": "m", "prompt": "Hello", "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}).json()
    texts: list[str] = []
    result = asyncio.run(measure(tiny_server, "m", STREAMS, TOKENS, texts=texts))
    assert result["complete_streams"] == STREAMS and result["tokens"] == STREAMS * TOKENS
    assert texts == [ref["choices"][0]["text"]] * STREAMS  # a backlog written at once loses and reorders nothing
    # Every engine step is its own chunk, also when the tiny model outruns the API process (it then writes several
    # chunks at once): a token per chunk, whatever the machine. How evenly they arrive is measured by
    # benchmarks/stream_smoothness.py (docs/benchmarks.md), not asserted here.
    assert result["max_tokens_in_chunk"] == 1 and result["chunks"] == STREAMS * TOKENS, result


def _metric(url: str, name: str, **labels: str) -> float:
    return metric(httpx.get(url + "/metrics", timeout=30).text, name, **labels)


def test_a_stream_is_sent_while_it_is_generated(tiny_server: str):
    """Order, not timing: a client that hangs up after its first chunk aborts the request, which therefore had not
    finished when that chunk arrived (240 tokens are ~240 engine steps, against one hang-up); a server that sent a
    stream only at the end of its request would finish it (finish reason length, every token generated)."""
    max_tokens = 240  # --max-model-len 256
    def finished(reason: str) -> float:
        return _metric(tiny_server, "vllm:request_success_total", finished_reason=reason)

    aborted0, completed0 = finished("abort"), finished("length")
    generated0 = _metric(tiny_server, "vllm:generation_tokens_total")
    body = {"model": "m", "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", tiny_server + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None
    deadline = time.monotonic() + 120  # a hang guard
    while finished("abort") == aborted0 and finished("length") == completed0:
        assert time.monotonic() < deadline, "the request never ended"
        time.sleep(0.02)
    assert (finished("abort"), finished("length")) == (aborted0 + 1, completed0), "it ran to its end"
    assert _metric(tiny_server, "vllm:num_requests_running") == 0
    assert _metric(tiny_server, "vllm:generation_tokens_total") - generated0 < max_tokens
