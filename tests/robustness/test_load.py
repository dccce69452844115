"""1,000 concurrent streaming connections to one server (the tiny model, short answers): every one gets its
whole answer and `data: [DONE]`; none is lost or cut off. Counts only: the per-stream timeout is a hang guard."""
from __future__ import annotations

import asyncio
import json

from robust_helpers import API_KEY
from robust_helpers import metric

import httpx

CONNECTIONS = 1000
MAX_TOKENS = 6


async def _one_stream(port: int, i: int) -> tuple[int, bool, int]:
    """Raw HTTP/1.1 over asyncio streams (a thousand httpx clients would cost more CPU than the server)."""
    body = json.dumps({"prompt": f"stream {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nConnection: close\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(-1), 400)  # a hang guard, not a speed bound
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    data = [line[6:] for line in _dechunk(body).decode().split("\n") if line.startswith("data: ")]
    tokens = 0
    for payload in data:
        if payload.startswith("{") and '"usage":{' in payload:
            tokens = json.loads(payload)["usage"]["completion_tokens"]
    return status, bool(data) and data[-1] == "[DONE]", tokens


def _dechunk(body: bytes) -> bytes:
    out, pos = [], 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2:end + 2 + size])
        pos = end + 2 + size + 2


async def _all(port: int) -> list:
    return await asyncio.gather(*[_one_stream(port, i) for i in range(CONNECTIONS)], return_exceptions=True)


def test_1000_concurrent_streams_all_complete(tiny_server) -> None:
    before = metric(httpx.get(tiny_server.url + "/metrics").text, "vllm:request_success_total")
    results = asyncio.run(_all(tiny_server.port))
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    bad = [r for r in results if r != (200, True, MAX_TOKENS)]
    assert not bad, (len(bad), bad[:3])
    after = metric(httpx.get(tiny_server.url + "/metrics").text, "vllm:request_success_total")
    assert after - before == CONNECTIONS  # each served exactly once (how fast is benchmarks' business)
