"""The HTTP side of `pagedllm bench serve`: a streaming client cheap enough never to be what is measured.

A GPU serving hundreds of streams sends tens of thousands of SSE chunks a second. One process of httpx spends
~100 us of CPU per chunk (a task wake-up, a line iterator, a response object per line), so at that rate the client,
not the server, would set the inter-token latency and the throughput measured. Here a plain-HTTP connection is an
asyncio.Protocol fed by httptools' response parser: each SSE event is parsed and timed inside `data_received`
(no task wake-up per chunk), and the requests can be split over several client processes (`--client-processes`),
each with its share of the concurrency and of the request rate. Each process reports the CPU it spent, so a run
can say whether its client kept up. An https:// server is driven through httpx (the `bench_serve` path).
"""
from __future__ import annotations

import asyncio
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

# A client process busier than this (CPU seconds per wall second) may have been the bottleneck of the run.
BUSY_CLIENT = 0.8
# Concurrent streams one client process takes in the default split (`client_processes_for`).
STREAMS_PER_PROCESS = 128


def client_processes_for(concurrency: int, cpus: Optional[int] = None) -> int:
    """The default split: one process per STREAMS_PER_PROCESS concurrent streams, at most a quarter of the cores
    (the server under test needs the rest when it runs on the same machine), at least one."""
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    return max(1, min(math.ceil(max(1, concurrency) / STREAMS_PER_PROCESS), cpus // 4, 8))


@dataclass
class RequestResult:
    """What one streamed request gave: its timings, tokens and chunks (bench_serve.summarize reads these)."""
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    start_time: float = 0.0  # when the request was sent (the client's clock)
    chunk_times: list[float] = field(default_factory=list)  # when each streamed piece arrived
    # tokens each streamed piece carried (its usage's completion_tokens minus the previous one's); empty when the
    # server did not send the usage on every chunk
    chunk_tokens: list[int] = field(default_factory=list)


@dataclass
class Target:
    """Where the requests go: a plain-HTTP server and the request path."""
    host: str
    port: int
    path: str
    headers: dict


def plain_http_target(url: str, headers: dict) -> Optional[Target]:
    """The Target of an http:// URL; None for anything the raw client does not speak (https)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return None
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(parts.hostname, parts.port or 80, path, headers)


class StreamRecorder:
    """What one streaming request gets: the same record `bench_serve._one_request` keeps, fed event by event."""

    __slots__ = ("res", "chat", "last", "usage_tokens", "num_chunks", "counted", "per_chunk_usage", "done",
                 "decode")

    def __init__(self, res: Any, chat: bool, decode: Callable[[bytes], Any]) -> None:
        self.res = res
        self.chat = chat
        self.last = res.start_time
        self.usage_tokens = None
        self.num_chunks = 0
        self.counted = 0
        self.per_chunk_usage = True
        self.done = False
        self.decode = decode

    def on_data(self, data: bytes, now: float) -> None:
        """One SSE `data:` payload that arrived at `now`."""
        if self.done:
            return
        if data == b"[DONE]":
            self.done = True
            return
        res = self.res
        try:
            obj = self.decode(data)
        except ValueError:  # (msgspec's DecodeError and json's are ValueErrors) the request failed, saying why
            res.error = f"the server sent an event that is not JSON: {bytes(data[:80])!r}"
            self.done = True
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            err = obj["error"]
            res.error = str(err.get("message") if isinstance(err, dict) else err)
            self.done = True
            return
        usage = obj.get("usage")
        if usage:
            self.usage_tokens = usage.get("completion_tokens")
        choices = obj.get("choices") or []
        if not choices:
            return
        piece = (choices[0].get("delta") or {}).get("content") if self.chat else choices[0].get("text")
        if not piece:
            return
        res.chunk_times.append(now)
        if usage and self.usage_tokens is not None and self.per_chunk_usage:
            res.chunk_tokens.append(self.usage_tokens - self.counted)
            self.counted = self.usage_tokens
        else:
            self.per_chunk_usage = False
        if self.num_chunks == 0:
            res.ttft = now - res.start_time
        else:
            res.itl.append(now - self.last)
        self.last = now
        self.num_chunks += 1

    def finish(self, now: float) -> None:
        res = self.res
        if res.error:
            return
        res.latency = now - res.start_time
        res.output_tokens = self.usage_tokens if self.usage_tokens is not None else self.num_chunks
        if not self.per_chunk_usage:
            res.chunk_tokens = []
        res.success = True


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time; the response body's SSE events go to the
    current StreamRecorder as they arrive."""

    def __init__(self) -> None:
        import httptools

        self._httptools = httptools
        self.transport: Optional[asyncio.Transport] = None
        self.closed = False
        self.reusable = False
        self._parser: Any = None
        self._recorder: Optional[StreamRecorder] = None
        self._done: Optional[asyncio.Future] = None
        self._status = 0
        self._pending = b""  # the body after the last complete event
        self._error_body = bytearray()
        self._now = 0.0
        self.answered = False  # bytes of the current request's response arrived

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            import socket

            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        if self._parser is None:
            return  # nothing asked for: a server speaking out of turn; the next request starts a fresh parser
        self._now = time.monotonic()
        self.answered = True
        try:
            self._parser.feed_data(data)
        except self._httptools.HttpParserUpgrade:
            self._fail(ConnectionError("the server upgraded the connection"))
        except self._httptools.HttpParserError as e:
            self._fail(ConnectionError(f"bad HTTP response: {e}"))

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.closed = True
        self._fail(exc or ConnectionError("the server closed the connection before the response ended"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self._status != 200:
            if len(self._error_body) < 4096:
                self._error_body += body
            return
        buf = self._pending + body if self._pending else body
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._pending = buf
            return
        self._pending = buf[end + 2:]
        recorder, now = self._recorder, self._now
        for event in buf[:end].split(b"\n\n"):
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    recorder.on_data(line[5:].strip(), now)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        self.reusable = self._parser.should_keep_alive()
        done, self._done = self._done, None
        self._parser = None
        if done is not None and not done.done():
            done.set_result(self._status)

    # the client side
    def start(self, request: bytes, recorder: StreamRecorder) -> asyncio.Future:
        """Send one request; the future resolves to the HTTP status once the whole response is in."""
        self._parser = self._httptools.HttpResponseParser(self)
        self._recorder = recorder
        self._status = 0
        self._pending = b""
        self._error_body = bytearray()
        self.reusable = False
        self.answered = False
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(request)  # type: ignore[union-attr]
        return self._done

    def error_text(self) -> str:
        return bytes(self._error_body).decode(errors="replace")[:200]

    def _fail(self, exc: BaseException) -> None:
        self.reusable = False
        done, self._done = self._done, None
        self._parser = None
        if done is not None and not done.done():
            done.set_exception(exc)
        if self.transport is not None and not self.closed:
            self.transport.close()


class _Pool:
    """Idle keep-alive connections to one server."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.idle: list[_Connection] = []

    async def get(self, fresh: bool = False) -> tuple[_Connection, bool]:
        """(a connection, whether it was used before)."""
        while self.idle and not fresh:
            conn = self.idle.pop()
            if not conn.closed:
                return conn, True
        _, conn = await asyncio.get_running_loop().create_connection(_Connection, self.target.host,
                                                                     self.target.port)
        return conn, False

    def put(self, conn: _Connection) -> None:
        if conn.reusable and not conn.closed:
            self.idle.append(conn)
        elif not conn.closed and conn.transport is not None:
            conn.transport.close()

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


def _request_bytes(target: Target, body: bytes) -> bytes:
    head = [f"POST {target.path} HTTP/1.1", f"Host: {target.host}:{target.port}", "Content-Type: application/json",
            "Accept: text/event-stream", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in target.headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


async def _one_raw(pool: _Pool, payload: dict, prompt_len: int, chat: bool, timeout: float, encode: Any,
                   decode: Any) -> Any:
    res = RequestResult(prompt_len=prompt_len)
    request = _request_bytes(pool.target, encode(payload))
    res.start_time = time.monotonic()
    recorder = StreamRecorder(res, chat, decode)
    conn: Optional[_Connection] = None
    try:
        for attempt in range(2):
            conn, reused = await pool.get(fresh=attempt > 0)
            try:
                status = await asyncio.wait_for(conn.start(request, recorder), timeout)
                break
            except ConnectionError:
                # A kept-alive connection the server closed meanwhile (its keep-alive timeout) fails before any
                # answer: send again, once, on a new connection.
                if not reused or conn.answered or attempt:
                    raise
        if status != 200:
            res.error = f"HTTP {status}: {conn.error_text()}"
        else:
            recorder.finish(time.monotonic())
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
        if conn is not None:
            conn.reusable = False
    if conn is not None:
        pool.put(conn)
    return res


async def run_requests(url: str, headers: dict, payloads: list[dict], prompt_lens: list[int], *, chat: bool,
                       limit: int, request_rate: float, seed: int, timeout: float,
                       on_done: Optional[Callable[[], None]] = None) -> list:
    """Every payload streamed to url (an http:// URL), at most `limit` at once, started at `request_rate` per
    second (Poisson; inf: all at once); the RequestResults in payload order."""
    import msgspec

    target = plain_http_target(url, headers)
    if target is None:
        raise ValueError(f"the raw client speaks plain HTTP only, not {url}")
    encode, decode = msgspec.json.encode, msgspec.json.decode
    pool = _Pool(target)
    semaphore = asyncio.Semaphore(max(1, limit))
    rng = random.Random(seed)

    async def go(payload: dict, prompt_len: int) -> Any:
        async with semaphore:
            r = await _one_raw(pool, payload, prompt_len, chat, timeout, encode, decode)
        if on_done is not None:
            on_done()
        return r

    tasks = []
    for payload, prompt_len in zip(payloads, prompt_lens):
        tasks.append(asyncio.create_task(go(payload, prompt_len)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        pool.close()


# ---- several client processes ---------------------------------------------------------------------------


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


@dataclass
class WorkerShare:
    """What one client process runs: its payloads, its concurrency, its request rate."""
    url: str
    headers: dict
    payloads: list
    prompt_lens: list
    chat: bool
    limit: int
    request_rate: float
    seed: int
    timeout: float


def split_work(n_items: int, limit: int, request_rate: float, processes: int) -> list[tuple[list[int], int, float]]:
    """Item indices (round-robin: every process gets the same mix of lengths), the concurrency and the request
    rate of each of `processes` client processes (fewer when there are fewer items or concurrency slots)."""
    processes = max(1, min(processes, n_items or 1, limit))
    shares = []
    for i in range(processes):
        share_limit = limit // processes + (1 if i < limit % processes else 0)
        shares.append((list(range(i, n_items, processes)), share_limit, request_rate / processes))
    return shares


def _worker_main(share: WorkerShare, go: Any, ready: Any, counter: Any, conn: Any) -> None:
    """One client process: wait for the common start, run its share, send back (results, cpu s, wall s)."""
    try:
        loop = new_event_loop()
        asyncio.set_event_loop(loop)

        def done() -> None:
            with counter.get_lock():
                counter.value += 1

        ready.set()
        go.wait()
        cpu0, t0 = time.process_time(), time.monotonic()
        results = loop.run_until_complete(run_requests(
            share.url, share.headers, share.payloads, share.prompt_lens, chat=share.chat, limit=share.limit,
            request_rate=share.request_rate, seed=share.seed, timeout=share.timeout, on_done=done))
        cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
        loop.close()
        conn.send(("ok", results, cpu, wall, time.monotonic()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the run
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


@dataclass
class ClientStats:
    processes: int
    busiest: float  # the busiest process's CPU seconds per wall second

    def describe(self) -> str:
        line = (f"{self.processes} client process{'es' if self.processes > 1 else ''}, the busiest at "
                f"{self.busiest * 100:.0f}% of a core")
        if self.busiest > BUSY_CLIENT:
            line += " (the client may have been the bottleneck: raise --client-processes)"
        return line


def run_processes(url: str, headers: dict, payloads: list[dict], prompt_lens: list[int], *, chat: bool,
                  limit: int, request_rate: float, seed: int, timeout: float, processes: int,
                  progress: Optional[Callable[[int], None]] = None) -> tuple[list, float, ClientStats]:
    """run_requests split over `processes` client processes (1: in this process). Returns the RequestResults
    in payload order, the duration from the common start to the last response, and the clients' CPU."""
    shares = split_work(len(payloads), limit, request_rate, processes)
    if len(shares) == 1:
        loop = new_event_loop()
        count = [0]

        def done() -> None:
            count[0] += 1
            if progress is not None:
                progress(count[0])

        try:
            cpu0, t0 = time.process_time(), time.monotonic()
            results = loop.run_until_complete(run_requests(
                url, headers, payloads, prompt_lens, chat=chat, limit=limit, request_rate=request_rate, seed=seed,
                timeout=timeout, on_done=done))
            wall = time.monotonic() - t0
            cpu = time.process_time() - cpu0
        finally:
            # An interrupted run's requests are cancelled and awaited: no "Task was destroyed but it is pending!"
            # for each at exit.
            unfinished = asyncio.all_tasks(loop)
            for task in unfinished:
                task.cancel()
            if unfinished:
                loop.run_until_complete(asyncio.gather(*unfinished, return_exceptions=True))
            loop.close()
        return results, wall, ClientStats(1, cpu / wall if wall else 0.0)
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # no fork of a parent that may hold threads (tqdm, the tokenizer's)
    go, counter = ctx.Event(), ctx.Value("i", 0)
    workers = []
    for i, (idx, share_limit, share_rate) in enumerate(shares):
        recv, send = ctx.Pipe(duplex=False)
        ready = ctx.Event()
        share = WorkerShare(url, headers, [payloads[j] for j in idx], [prompt_lens[j] for j in idx], chat,
                            share_limit, share_rate, seed * 1000 + i, timeout)
        proc = ctx.Process(target=_worker_main, args=(share, go, ready, counter, send), daemon=True,
                           name=f"bench-client-{i}")
        proc.start()
        send.close()
        workers.append((proc, recv, ready, idx))
    try:
        for proc, _, ready, _ in workers:
            while not ready.wait(0.5):
                if not proc.is_alive():
                    raise RuntimeError(f"client process {proc.name} exited before the start "
                                       f"(exit code {proc.exitcode})")
        start = time.monotonic()
        go.set()
        replies: list = [None] * len(workers)
        pending = set(range(len(workers)))
        last = -1
        while pending:
            for k in list(pending):
                proc, recv, _, _ = workers[k]
                if recv.poll(0.05):
                    replies[k] = recv.recv()
                    pending.discard(k)
                elif not proc.is_alive() and not recv.poll():
                    raise RuntimeError(f"client process {proc.name} died (exit code {proc.exitcode})")
            if progress is not None and counter.value != last:
                last = counter.value
                progress(last)
        results: list = [None] * len(payloads)
        end, busiest = start, 0.0
        for (_, _, _, idx), reply in zip(workers, replies):
            if reply[0] != "ok":
                raise RuntimeError(f"a client process failed: {reply[1]}")
            _, res, cpu, wall, finished = reply
            for j, r in zip(idx, res):
                results[j] = r
            end = max(end, finished)
            busiest = max(busiest, cpu / wall if wall else 0.0)
        return results, end - start, ClientStats(len(workers), busiest)
    finally:
        for proc, recv, _, _ in workers:
            recv.close()
            if proc.is_alive():
                proc.terminate()
            proc.join(5)
