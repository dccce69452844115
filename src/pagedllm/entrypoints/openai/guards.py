"""HTTP-level guards in front of the app (pure ASGI, before any route runs):

- a request body over `--max-request-body-bytes` is refused with 413, from its Content-Length before a byte
  of it is read, or as soon as a chunked body passes the limit;
- a POST body that is not JSON by its Content-Type gets 415, and one that is not valid UTF-8 gets 400;
- a client that stops reading its response (a stream nobody consumes) is cut off when one write has waited
  `--send-timeout` seconds: its request is aborted (KV freed), and the engine never waits for it.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from pagedllm.entrypoints.openai.errors import dumps, error_body

logger = logging.getLogger("pagedllm.api_server")

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
DEFAULT_SEND_TIMEOUT_S = 60.0
_BODY_METHODS = (b"POST", b"PUT", b"PATCH")


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class _Gone(Exception):
    pass


class RequestGuard:
    def __init__(self, app: Any, max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            if scope.get("method", "").encode() in _BODY_METHODS:
                receive = await self._checked_body(scope, receive)
        except _Gone:
            return
        except _Refused as e:
            await _send_error(send, e)
            return
        try:
            await self.app(scope, receive, self._timed_send(scope, send))
        except BaseException as e:  # noqa: BLE001 - only a cut-off slow client is absorbed here
            if not _is_too_slow(e):
                raise
            # Returning with the response unfinished makes uvicorn close the connection.

    async def _checked_body(self, scope: dict, receive: Any) -> Any:
        headers = dict(scope.get("headers") or [])
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
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            more = message.get("more_body", False)
        if tail is not None:  # the client left before its body was complete: nobody to answer
            raise _Gone()
        body = b"".join(chunks)
        if body:
            _check_json_content_type(headers.get(b"content-type"))
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _Refused(400, f"The request body is not valid UTF-8 (invalid byte at offset {e.start}); "
                                    "JSON bodies must be UTF-8.")
        return _replay(body, tail, receive)

    def _too_large(self) -> _Refused:
        return _Refused(413, f"The request body is larger than the server's limit of {self.max_body_bytes} bytes "
                             "(--max-request-body-bytes).", code="request_too_large")

    def _timed_send(self, scope: dict, send: Any) -> Any:
        timeout = self.send_timeout_s
        if timeout <= 0:
            return send

        async def timed(message: dict) -> None:
            try:
                if _timeout is not None:  # a timer on this task: no task per write (wait_for makes one on 3.11)
                    async with _timeout(timeout):
                        await send(message)
                else:
                    await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                client = scope.get("client") or ("?", 0)
                logger.warning("client %s:%s did not read its response for %.0f s (--send-timeout): cut off",
                               client[0], client[1], timeout)
                raise ClientTooSlow() from None

        return timed


# asyncio.timeout (Python >= 3.11): every SSE chunk goes through timed(); a streaming server writes thousands a second.
_timeout = getattr(asyncio, "timeout", None)


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


async def _send_error(send: Any, e: _Refused) -> None:
    body = dumps(error_body(e.message, e.status, code=e.code))
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
