"""bench_client, the load generator's raw streaming client: its SSE parsing over a real socket (events split at
every byte, CRLF framing, errors, closed connections, keep-alive reuse), the split over client processes, and
summarize at the sizes a fast GPU server produces."""
from __future__ import annotations

import asyncio
import json
import math
import statistics
import threading
from typing import Callable

import pytest

from pagedllm.entrypoints.cli import bench_client as bc
from pagedllm.entrypoints.cli.bench_serve import RequestResult, summarize


def _sse(texts: list[str], usage: bool = True, crlf: bool = False) -> bytes:
    sep = "\r\n\r\n" if crlf else "\n\n"
    body = ""
    for i, t in enumerate(texts):
        chunk = {"choices": [{"index": 0, "text": t}]}
        if usage:
            chunk["usage"] = {"completion_tokens": i + 1}
        body += "data: " + json.dumps(chunk) + sep
    body += "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": len(texts)}}) + sep
    return (body + "data: [DONE]" + sep).encode()


class _Server:
    """A plain asyncio HTTP/1.1 server on a thread: each request is answered by respond(body) -> (status,
    [pieces]), every piece written (and flushed) on its own with a small pause, as chunked transfer encoding.
    Counts the connections it accepted."""

    def __init__(self, respond: Callable[[dict], tuple[int, list[bytes]]], close_after: bool = False) -> None:
        self.respond = respond
        self.close_after = close_after
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length"))
                    body = json.loads(await reader.readexactly(length))
                    status, pieces = self.respond(body)
                    if status != 200:
                        msg = pieces[0]
                        writer.write(b"HTTP/1.1 %d Err\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                     % (status, len(msg)) + msg)
                        await writer.drain()
                        continue
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
                    for piece in pieces:
                        writer.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
                        await writer.drain()
                        await asyncio.sleep(0.001)
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
                    if self.close_after:
                        writer.close()
                        return
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        async def main() -> None:
            self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            started.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(main()), self.loop.run_forever()),
                                       daemon=True)
        self.thread.start()
        started.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/completions"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _run(url: str, payloads: list[dict], limit: int = 4, processes: int = 1, chat: bool = False):
    return bc.run_processes(url, {"Authorization": "Bearer k"}, payloads, [3] * len(payloads), chat=chat,
                            limit=limit, request_rate=float("inf"), seed=0, timeout=30, processes=processes)


@pytest.mark.parametrize("crlf", [False, True])
def test_events_split_at_every_byte_are_parsed_and_timed(crlf: bool) -> None:
    texts = ["Hello", " wor", "ld", "!", " é"]
    body = _sse(texts, crlf=crlf)
    srv = _Server(lambda req: (200, [body[i:i + 1] for i in range(len(body))]))
    try:
        results, duration, stats = _run(srv.url, [{"n": i} for i in range(3)])
    finally:
        srv.stop()
    assert duration > 0 and stats.processes == 1
    for r in results:
        assert r.success and not r.error, r.error
        assert r.output_tokens == len(texts) and r.chunk_tokens == [1] * len(texts)
        assert len(r.chunk_times) == len(texts) and len(r.itl) == len(texts) - 1
        assert 0 < r.ttft <= r.latency and all(t >= 0 for t in r.itl)


@pytest.mark.parametrize("crlf", [False, True])
def test_raw_unicode_line_separators_inside_events_keep_them_whole(crlf: bool) -> None:
    """A server may leave U+2028 / U+2029 / U+0085 raw inside an event's JSON (valid JSON and SSE): both clients (the
    raw one and the httpx one of https URLs) split lines at LF only."""
    import httpx

    from pagedllm.entrypoints.cli.bench_serve import _one_request

    texts = ["a\u2028b", "\x85", "c\u2029d", "e"]
    body = _sse(texts, crlf=crlf).replace(b"\\u2028", "\u2028".encode()).replace(
        b"\\u2029", "\u2029".encode()).replace(b"\\u0085", "\x85".encode())
    assert "\u2028".encode() in body and "\x85".encode() in body
    srv = _Server(lambda req: (200, [body[i:i + 3] for i in range(0, len(body), 3)]))

    async def with_httpx() -> RequestResult:
        async with httpx.AsyncClient(timeout=30) as client:
            return await _one_request(client, srv.url, {}, {}, 3, chat=False)

    try:
        (raw,), _, _ = _run(srv.url, [{}])
        via_httpx = asyncio.run(with_httpx())
    finally:
        srv.stop()
    for r in (raw, via_httpx):
        assert r.success and not r.error, r.error
        assert r.output_tokens == len(texts) and r.chunk_tokens == [1] * len(texts)


def test_whole_response_in_one_piece_and_chunks_of_several_tokens() -> None:
    # one piece: every event arrives at once (ITLs of 0); usage jumping by 3: a chunk carried 3 tokens
    body = b"".join(b"data: " + json.dumps({"choices": [{"text": "ab"}], "usage": {"completion_tokens": n}}).encode()
                    + b"\n\n" for n in (1, 4, 5)) + b"data: [DONE]\n\n"
    srv = _Server(lambda req: (200, [body]))
    try:
        (r,), _, _ = _run(srv.url, [{}])
    finally:
        srv.stop()
    assert r.success and r.output_tokens == 5 and r.chunk_tokens == [1, 3, 1] and r.itl == [0.0, 0.0]


def test_chat_deltas_and_no_usage_per_chunk() -> None:
    sse = b"".join(b"data: " + json.dumps({"choices": [{"delta": {"content": c}}]}).encode() + b"\n\n"
                   for c in ("a", "b", "c")) + b"data: [DONE]\n\n"
    srv = _Server(lambda req: (200, [sse[:7], sse[7:40], sse[40:]]))
    try:
        (r,), _, _ = _run(srv.url.replace("completions", "chat/completions"), [{}], chat=True)
    finally:
        srv.stop()
    assert r.success and r.output_tokens == 3 and r.chunk_tokens == [] and len(r.itl) == 2


def test_errors_are_recorded_not_raised() -> None:
    def respond(req: dict) -> tuple[int, list[bytes]]:
        if req.get("bad"):
            return 404, [b'{"error": {"message": "no such model"}}']
        if req.get("stream_error"):
            return 200, [b'data: {"error": {"message": "boom", "code": 500}}\n\n', b"data: [DONE]\n\n"]
        if req.get("not_json"):
            return 200, [b"data: {not json\n\n", b"data: [DONE]\n\n"]
        return 200, [_sse(["x"])]

    srv = _Server(respond)
    try:
        results, _, _ = _run(srv.url, [{"bad": True}, {}, {"stream_error": True}, {}, {"not_json": True}, {}],
                             limit=1)
    finally:
        srv.stop()
    assert [r.success for r in results] == [False, True, False, True, False, True]
    assert results[0].error.startswith("HTTP 404") and "no such model" in results[0].error
    assert results[2].error == "boom"
    # an event that is not JSON was "bad HTTP response: `on_body` callback error" (and the connection dropped)
    assert "not JSON" in results[4].error and "{not json" in results[4].error, results[4].error
    refused, _, _ = _run(f"http://127.0.0.1:{_free_port()}/v1/completions", [{}])
    assert not refused[0].success and "Connect" in refused[0].error


def _free_port() -> int:
    from pagedllm.entrypoints.server_process import free_port

    return free_port()


def test_keep_alive_connections_are_reused_and_a_closing_server_is_followed() -> None:
    body = _sse(["a", "b"])
    srv = _Server(lambda req: (200, [body]))
    try:
        results, _, _ = _run(srv.url, [{} for _ in range(12)], limit=3)
        assert all(r.success for r in results) and srv.connections <= 3
    finally:
        srv.stop()
    closing = _Server(lambda req: (200, [body]), close_after=True)
    try:
        results, _, _ = _run(closing.url, [{} for _ in range(6)], limit=2)
        assert all(r.success for r in results), [r.error for r in results]
        assert closing.connections == 6
    finally:
        closing.stop()


def test_several_client_processes_return_every_result_in_order() -> None:
    def respond(req: dict) -> tuple[int, list[bytes]]:
        return 200, [_sse(["t"] * req["n"])]

    srv = _Server(respond)
    try:
        payloads = [{"n": 1 + i % 5} for i in range(20)]
        results, duration, stats = _run(srv.url, payloads, limit=6, processes=3)
    finally:
        srv.stop()
    assert stats.processes == 3 and duration > 0 and 0 <= stats.busiest
    assert [r.output_tokens for r in results] == [p["n"] for p in payloads]
    assert all(r.success for r in results)


def test_split_work_covers_every_request_and_the_whole_concurrency() -> None:
    for n, limit, procs in ((10, 4, 3), (3, 8, 4), (100, 7, 7), (5, 1, 4)):
        shares = bc.split_work(n, limit, 12.0, procs)
        assert len(shares) == min(procs, n, limit)
        assert sorted(i for idx, _, _ in shares for i in idx) == list(range(n))
        assert sum(lim for _, lim, _ in shares) == limit and all(lim >= 1 for _, lim, _ in shares)
        assert math.isclose(sum(rate for _, _, rate in shares), 12.0)
    assert bc.client_processes_for(1024, cpus=16) == 4 and bc.client_processes_for(256, cpus=16) == 2
    assert bc.client_processes_for(1024, cpus=2) == 1 and bc.client_processes_for(10, cpus=64) == 1
    assert bc.plain_http_target("https://h/v1/completions", {}) is None
    t = bc.plain_http_target("http://h:81/v1/completions?x=1", {"A": "b"})
    assert (t.host, t.port, t.path) == ("h", 81, "/v1/completions?x=1")


def test_summarize_at_gpu_scale_matches_statistics() -> None:
    # 4096 streams of ~100 one-token chunks: the sizes of a 1024-concurrency GPU run (the standard deviation was
    # once quadratic in them)
    results = [RequestResult(True, 88, 100, 0.01 * (1 + i % 7), 1.0, [0.001 * (1 + (i + j) % 13) for j in range(99)],
                             chunk_tokens=[1] * 100) for i in range(4096)]
    m = summarize(results, 10.0)
    itls = [x for r in results for x in r.itl]
    assert math.isclose(m["std_itl_ms"], statistics.pstdev(itls) * 1000, rel_tol=1e-9)
    assert math.isclose(m["mean_ttft_ms"], statistics.fmean(r.ttft for r in results) * 1000, rel_tol=1e-9)
    assert m["completed"] == 4096 and m["total_output_tokens"] == 409600 and m["p99_tokens_per_chunk"] == 1
