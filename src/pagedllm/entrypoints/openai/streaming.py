"""What chat and completions share around a generation: client-disconnect watching, merging several
output streams, the Server-Sent-Events framing of chunks, usage, in-band errors and [DONE], and the response
that writes them."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import dumps, error_body
from pagedllm.entrypoints.openai.guards import RAW_SEND_KEY

DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


class SSEResponse(Response):
    """A text/event-stream response: each item of `body` (the SSE frames of one engine step) is one write.

    Unlike StreamingResponse it runs in the request's own task (no task group and no second reader of the
    client's messages: start_disconnect_watch already turns a disconnect into an abort, which ends `body`), and
    it sends the body to scope["pagedllm.send"] (RequestGuard's send: the send timeout, then uvicorn), past the
    framework middlewares' per-message wrappers; the response start still goes through them (CORS headers)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.background = None
        self.raw_headers = list(_SSE_HEADERS)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        raw = scope.get(RAW_SEND_KEY, send)
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            async for frames in self.body_iterator:
                await raw({"type": "http.response.body", "body": frames, "more_body": True})
        finally:  # also when a write failed (--send-timeout): the body's own cleanup aborts the request
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        await raw({"type": "http.response.body", "body": b"", "more_body": False})
        if self.background is not None:
            await self.background()


class ChunkFramer:
    """SSE `data:` frames of one response's chunks: the fixed id/object/created/model prefix is encoded once.

    stream_options: `include_usage` adds `"usage": null` to every chunk and a final usage-only chunk;
    `continuous_usage_stats` (vLLM) puts the usage so far on every chunk instead (and implies include_usage).
    """

    def __init__(self, request_id: str, obj: str, created: int, model: str, stream_options: Any) -> None:
        # stream_options: the request's StreamOptions (or None), or a plain include_usage bool
        if isinstance(stream_options, bool) or stream_options is None:
            self.continuous_usage, self.include_usage = False, bool(stream_options)
        else:
            self.continuous_usage = bool(stream_options.continuous_usage_stats)
            self.include_usage = self.continuous_usage or bool(stream_options.include_usage)
        self.head = (b'{"id":' + dumps(request_id) + b',"object":' + dumps(obj) + b',"created":'
                     + str(created).encode() + b',"model":' + dumps(model) + b',"choices":')
        self.tail = b',"usage":null}\n\n' if self.include_usage else b"}\n\n"

    def choices(self, choices: list[dict], usage: Optional[dict] = None) -> bytes:
        if self.continuous_usage and usage is not None:
            return b"data: " + self.head + dumps(choices) + b',"usage":' + dumps(usage) + b"}\n\n"
        return b"data: " + self.head + dumps(choices) + self.tail

    def usage(self, usage: dict) -> bytes:
        """The final usage-only chunk (stream_options.include_usage): no choices."""
        return b"data: " + self.head + b"[]" + b',"usage":' + dumps(usage) + b"}\n\n"


def error_event(e: BaseException) -> bytes:
    """An error after the headers went out is reported in-band, as vLLM does."""
    status = getattr(e, "status", 500)
    return b"data: " + dumps(error_body(str(e), status)) + b"\n\n"


def start_disconnect_watch(request: Request, engine: Any, request_ids: list[str]) -> asyncio.Task:
    """Until the returned task is cancelled, a client disconnect aborts `request_ids` at once (their KV
    blocks are freed in the engine's next loop turn, and their generate() raises ClientDisconnected)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message.get("type") == "http.disconnect":
                for rid in request_ids:
                    engine.abort_nowait(rid)
                return

    return asyncio.get_running_loop().create_task(watch())


async def merge_streams(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators, yielding (which, item) as items arrive."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, e))

    tasks = [asyncio.get_running_loop().create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(gens)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            aclose = getattr(g, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


def usage_dict(num_prompt: int, num_generated: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_generated, "total_tokens": num_prompt + num_generated}
