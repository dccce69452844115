"""HTTP-level guards in front of the app (pure ASGI, before any route runs, outermost of the server's layers):

- a request body over `--max-request-body-bytes` is refused with 413, from its Content-Length before a byte
  of it is read, or as soon as a chunked body passes the limit;
- a POST body that is not JSON by its Content-Type, or is compressed (Content-Encoding), gets 415, and one that is
  not valid UTF-8 gets 400;
- an error answered before the client has sent its whole body gets a lingering close, as nginx does: the
  answer goes out, the rest of the body is read and dropped (for at most LINGER_TOTAL_S, LINGER_READ_S without
  data, LINGER_MAX_BYTES), then the connection closes. Closing a socket with unread data makes the kernel send a
  reset, and a client still sending would see the reset instead of the answer. Every other layer (the drain's
  503, the API key's 401, routes) runs after the body was read here, so its early answers are safe too;
- a client that stops reading its response (a stream nobody consumes) is cut off when one write has waited
  `--send-timeout` seconds: its request is aborted (KV freed), and the engine never waits for it.

The send it hands down is also in scope["pagedllm.send"]: streaming responses send their body there, past the
framework's per-message wrappers (which only look at the response start). The server's own send is in
scope["pagedllm.server_send"], for `direct_writer`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

from pagedllm.entrypoints.openai.errors import dumps, error_body


def route_path(scope: dict) -> str:
    """The path the routes match: uvicorn puts --root-path (the prefix a proxy serves this server under, which the
    proxy strips) in front of scope["path"]; every path check (the API key, the hot routes, the drain) takes it off,
    as the framework's router does."""
    path = scope.get("path", "")
    root = scope.get("root_path") or ""
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path

logger = logging.getLogger("pagedllm.api_server")

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
DEFAULT_SEND_TIMEOUT_S = 60.0
_BODY_METHODS = (b"POST", b"PUT", b"PATCH")
# Lingering close after an early answer (nginx: lingering_time 30 s, lingering_timeout 5 s).
LINGER_TOTAL_S = 30.0
LINGER_READ_S = 5.0
LINGER_MAX_BYTES = 1 << 30
RAW_SEND_KEY = "pagedllm.send"
SERVER_SEND_KEY = "pagedllm.server_send"


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.body_unread = False  # the client may still be sending: answer with a lingering close


class _Gone(Exception):
    pass


class RequestGuard:
    def __init__(self, app: Any, max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S, request_id_headers: bool = False) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.send_timeout_s = send_timeout_s
        # --enable-request-id-headers: RequestIdHeaders sits inside, so this guard's own refusals add the header
        self.request_id_headers = request_id_headers

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        try:
            if _has_body(scope, headers):
                receive = await self._checked_body(scope, headers, receive)
        except _Gone:
            return
        except _Refused as e:
            if self.request_id_headers:
                send = RequestIdHeaders.with_id(scope, send)
            await refuse(send, receive, e.status, e.message, e.code,
                         linger=e.body_unread and headers.get(b"expect", b"").lower() != b"100-continue")
            return
        timed, watch = self._timed_send(scope, send)
        scope[RAW_SEND_KEY] = timed
        scope[SERVER_SEND_KEY] = send
        try:
            await self.app(scope, receive, timed)
        except BaseException as e:  # noqa: BLE001 - only a cut-off slow client is absorbed here
            if not _is_too_slow(e):
                raise
            # Returning with the response unfinished makes uvicorn close the connection.
        finally:
            if watch is not None:
                watch.close()

    async def _checked_body(self, scope: dict, headers: dict, receive: Any) -> Any:
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise self._too_large()
        chunks, size, more, tail = [], 0, True, None
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                tail = message
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                refused = self._too_large()
                refused.body_unread = more
                raise refused
            chunks.append(chunk)
        if tail is not None:  # the client left before its body was complete: nobody to answer
            raise _Gone()
        body = b"".join(chunks)
        if body and scope.get("method", "").encode() in _BODY_METHODS:
            _check_json_content_type(headers.get(b"content-type"))
            _check_content_encoding(headers.get(b"content-encoding"))
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _Refused(400, f"The request body is not valid UTF-8 (invalid byte at offset {e.start}); "
                                    "JSON bodies must be UTF-8.")
        return _replay(body, tail, receive)

    def _too_large(self) -> _Refused:
        refused = _Refused(413, f"The request body is larger than the server's limit of {self.max_body_bytes} "
                                "bytes (--max-request-body-bytes).", code="request_too_large")
        refused.body_unread = True
        return refused

    def _timed_send(self, scope: dict, send: Any) -> tuple[Any, Optional["_SendWatch"]]:
        if self.send_timeout_s <= 0:
            return send, None
        watch = _SendWatch(self.send_timeout_s, scope)
        return watch.wrap(send), watch


class _SendWatch:
    """--send-timeout for one request without a timer per write (a stream writes thousands of chunks a second):
    each write only notes when it started; one timer per request, re-armed lazily, cuts off a write that has
    waited `timeout` seconds by cancelling the task blocked in it, which then raises ClientTooSlow."""

    def __init__(self, timeout: float, scope: dict) -> None:
        self.timeout = timeout
        self.scope = scope
        self.loop = asyncio.get_running_loop()
        self.started: Optional[float] = None  # loop time the write in progress began; None: no write waits
        self.task: Optional[asyncio.Task] = None  # the task doing that write
        self.expired = False
        self.timer: Optional[asyncio.TimerHandle] = None

    def wrap(self, send: Any) -> Any:
        loop, current_task = self.loop, asyncio.current_task

        async def timed(message: dict) -> None:
            if self.expired:
                raise ClientTooSlow()
            self.task = current_task()
            self.started = loop.time()
            if self.timer is None:
                self.timer = loop.call_at(self.started + self.timeout, self._check)
            try:
                await send(message)
            except asyncio.CancelledError:
                if not self.expired:
                    raise
                uncancel = getattr(self.task, "uncancel", None)  # Python >= 3.11: the cancel was ours
                if uncancel is not None:
                    uncancel()
                raise ClientTooSlow() from None
            finally:
                self.started = None

        return timed

    def _check(self) -> None:
        now = self.loop.time()
        started = self.started
        if started is not None and now - started >= self.timeout and self.task is not None:
            client = self.scope.get("client") or ("?", 0)
            logger.warning("client %s:%s did not read its response for %.0f s (--send-timeout): cut off",
                           client[0], client[1], self.timeout)
            self.expired = True
            self.timer = None
            self.task.cancel()
            return
        self.timer = self.loop.call_at((started if started is not None else now) + self.timeout, self._check)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def direct_writer(send: Any) -> Optional[tuple[Any, Any]]:
    """(writable, write) for a started chunked response of uvicorn's httptools protocol, whose send is `send`:
    writable() says whether a body chunk can go out now without waiting (the client reads: no flow-control
    pause; still connected), write(body) writes it as send({"type": "http.response.body", "body": body,
    "more_body": True}) would, without an awaitable and a message dict per chunk. None for any other server
    or response (then only send writes)."""
    cycle = getattr(send, "__self__", None)
    if type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl" or type(cycle).__name__ != "RequestResponseCycle":
        return None
    try:
        if (not cycle.response_started or cycle.response_complete or cycle.chunked_encoding is not True
                or cycle.scope.get("method") == "HEAD"):
            return None
        flow, transport = cycle.flow, cycle.transport
    except AttributeError:  # another uvicorn version's internals: keep to send
        return None

    def writable() -> bool:
        return not flow.write_paused and not cycle.disconnected

    def write(body: bytes) -> None:
        if body and not cycle.disconnected:  # a gone client's bytes are dropped, as send drops them
            transport.write(b"%x\r\n%b\r\n" % (len(body), body))

    return writable, write


class ClientTooSlow(Exception):
    """Raised into the app by a write that waited --send-timeout: the response is abandoned, the request aborted
    and the connection closed by the server."""


def _is_too_slow(e: BaseException) -> bool:
    if isinstance(e, ClientTooSlow):
        return True
    inner = getattr(e, "exceptions", None)  # an exception group from the response's task group
    return bool(inner) and all(_is_too_slow(x) for x in inner)


def _check_json_content_type(value: Optional[bytes]) -> None:
    if value is None:  # curl-style clients that send none: take the body as JSON
        return
    media = value.split(b";", 1)[0].strip().lower()
    if media == b"application/json" or media.endswith(b"+json"):
        return
    raise _Refused(415, f"Unsupported Content-Type {media.decode('latin-1')!r}: send the body as JSON with "
                        "'Content-Type: application/json'.", code="unsupported_media_type")


def _check_content_encoding(value: Optional[bytes]) -> None:
    # A compressed body would reach the JSON decoder as bytes that are no UTF-8 ("not valid UTF-8" misled)
    if value is None or value.strip().lower() in (b"", b"identity"):
        return
    raise _Refused(415, f"Unsupported Content-Encoding {value.decode('latin-1')!r}: send the JSON body "
                        "uncompressed.", code="unsupported_media_type")


def _replay(body: bytes, tail: Optional[dict], receive: Any) -> Any:
    """A receive() that yields the already-read body once, then the client's own messages (disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    if tail is not None:
        pending.append(tail)

    async def replayed() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def _has_body(scope: dict, headers: dict) -> bool:
    """Whether the request may carry a body: a POST / PUT / PATCH, or any request that announces one."""
    if scope.get("method", "").encode() in _BODY_METHODS or b"transfer-encoding" in headers:
        return True
    length = headers.get(b"content-length")
    return length is not None and length not in (b"0", b"")


async def refuse(send: Any, receive: Any, status: int, message: str, code: Optional[str] = None,
                 linger: bool = False, extra_headers: tuple = ()) -> None:
    """An error answer that closes the connection. `linger`: the client may still be sending its body, so the
    answer goes out complete (its Content-Length is exact), then the body is read and dropped, and only then is
    the response ended (uvicorn closes the connection at that moment)."""
    body = dumps(error_body(message, status, code=code))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *extra_headers]})
    if not linger:
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await drain_body(receive)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def drain_body(receive: Any) -> bool:
    """Read and drop what the client still sends of its body, within the lingering bounds. True when the body
    ended (or the client left) within them."""
    deadline = time.monotonic() + LINGER_TOTAL_S
    size = 0
    while size <= LINGER_MAX_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            message = await asyncio.wait_for(receive(), min(LINGER_READ_S, left))
        except asyncio.TimeoutError:
            return False
        if message["type"] != "http.request" or not message.get("more_body", False):
            return True
        size += len(message.get("body", b""))
    return False


class RequestIdHeaders:
    """--enable-request-id-headers (vLLM's): every HTTP answer carries X-Request-Id, the request's own header when it
    sent one (a proxy's trace id), else a new one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, self.with_id(scope, send))

    @staticmethod
    def with_id(scope: dict, send: Any) -> Any:
        """`send` with X-Request-Id added to the answer's headers."""
        import uuid

        value = next((v for k, v in scope["headers"] if k == b"x-request-id"), None) or uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", ()), (b"x-request-id", value)])
            await send(message)

        return send_with_id
