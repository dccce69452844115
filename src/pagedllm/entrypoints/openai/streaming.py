"""What chat and completions share around a generation: client-disconnect watching, merging several
output streams, the Server-Sent-Events framing of chunks, usage, in-band errors and [DONE], and the response
that writes them."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import dumps, error_body, log_error_stack
from pagedllm.entrypoints.openai.guards import RAW_SEND_KEY, SERVER_SEND_KEY, direct_writer

DONE = b"data: [DONE]\n\n"
# U+0085, U+2028 and U+2029 may stand raw in a JSON string, and SSE breaks lines at CR / LF only, but a client that
# splits the stream like str.splitlines (httpx's iter_lines, Python's io) would cut an event there: escaped, every
# client reads it whole. In UTF-8 these byte sequences encode only those code points, which only text strings hold.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def line_safe(data: bytes) -> bytes:
    """SSE bytes (or one encoded JSON string) with the Unicode line separators escaped."""
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


class SSEStream:
    """One streamed generation as SSE bytes, for SSEResponse: prefix() (frames before any output, e.g. the
    role), frames(item) for the first item and for every later item of `batches` (an item: the outputs that
    arrived since the last write, one chunk per engine step), then tail(error): the usage chunk and [DONE], or
    the error in-band (headers are gone) and [DONE]. close() stops the disconnect watch and the generation
    (aborting it in the engine if it did not finish)."""

    # A plain stream (one request, one choice, no logprobs, tools or echo) sets (engine, request id): its
    # running steps may then be framed by direct_frame and written by the engine's output handler itself.
    direct: Optional[tuple[Any, str]] = None

    def __init__(self, batches: AsyncIterator, first: Any, watch: asyncio.Task, framer: "ChunkFramer") -> None:
        self.batches = batches
        self.first = first
        self.watch = watch
        self.framer = framer
        self.choice_gen = [0]  # each choice's tokens so far (a subclass sizes it to its choices)

    def direct_frame(self, text: str, num_tokens: int) -> bytes:
        """The frame of a running step of the plain stream's only choice, byte for byte what frames() writes
        (from the subclass's pre-built templates and token counts: chat and completions keep the same ones)."""
        self.num_gen += num_tokens
        self.choice_gen[0] += num_tokens  # (the only choice's count, which the subclass's own frames read)
        before, after = self.templates[0]
        return before + line_safe(dumps(text)) + after + self.framer.end(self.num_prompt, self.num_gen)

    def direct_framer(self) -> Any:
        """direct_frame as one closure, for the engine's output handler (called once per token): without
        continuous usage stats a frame's end is fixed, so it is joined to the template once."""
        if self.framer.continuous_usage:
            return self.direct_frame
        before, after = self.templates[0]
        after += self.framer.end(self.num_prompt, self.num_gen)
        encode = dumps

        def frame(text: str, num_tokens: int) -> bytes:
            self.num_gen += num_tokens
            return before + line_safe(encode(text)) + after

        return frame

    def prefix(self) -> bytes:
        return b""

    def frames(self, item: Any) -> bytes:
        raise NotImplementedError

    def usage(self) -> dict:
        raise NotImplementedError

    def tail(self, error: Optional[BaseException]) -> bytes:
        if error is not None:
            return error_event(error) + DONE
        return (self.framer.usage(self.usage()) if self.framer.include_usage else b"") + DONE

    async def close(self) -> None:
        self.watch.cancel()
        await self.batches.aclose()


class SSEResponse(Response):
    """A text/event-stream response: one write per item of the stream (the frames of the engine steps that
    arrived since the last write).

    The writing runs in a task of its own: a task resumed once per chunk should be shallow, and the request's
    task sits under a dozen middleware frames, each resumed with it. The bytes go to scope["pagedllm.send"]
    (RequestGuard's send: the send timeout, then uvicorn), past the framework middlewares' per-message wrappers;
    the response start still goes through them (CORS headers). No second reader of the client's messages:
    start_disconnect_watch already turns a disconnect into an abort, which ends the stream."""

    media_type = "text/event-stream"

    def __init__(self, stream: SSEStream) -> None:
        self.stream = stream
        self.status_code = 200
        self.background = None
        self.raw_headers = list(_SSE_HEADERS)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        raw = scope.get(RAW_SEND_KEY, send)
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        # Cancelling this task (a forced shutdown) cancels the writer it awaits.
        await asyncio.get_running_loop().create_task(self._write(raw, scope.get(SERVER_SEND_KEY)))
        if self.background is not None:
            await self.background()

    async def _write(self, raw: Any, server_send: Any) -> None:
        stream = self.stream
        stop_direct = None
        try:
            pending, error = stream.prefix(), None
            try:
                pending += stream.frames(stream.first)
            except Exception as e:  # noqa: BLE001 - reported in-band
                error = e
            if error is None:
                if pending:
                    await raw({"type": "http.response.body", "body": line_safe(pending), "more_body": True})
                    pending = b""
                stop_direct = _start_direct(stream, server_send)
                error = await self._write_items(raw, stream)
            if stop_direct is not None:
                stop_direct()
                stop_direct = None
            if error is not None:
                log_error_stack(error)
            await raw({"type": "http.response.body", "body": line_safe(pending + stream.tail(error)),
                       "more_body": False})
        finally:  # also when a write failed (--send-timeout): stops the generation, aborting it in the engine
            if stop_direct is not None:
                stop_direct()
            await stream.close()

    @staticmethod
    async def _write_items(raw: Any, stream: SSEStream) -> Optional[BaseException]:
        """Write every later item; the generation's error, if one ended it (a failed write raises instead)."""
        items = stream.batches.__aiter__()
        frames = stream.frames
        while True:
            try:
                item = await items.__anext__()
                body = frames(item)
            except StopAsyncIteration:
                return None
            except Exception as e:  # noqa: BLE001 - the engine died, the request was refused, ...: in-band
                return e
            if body:
                await raw({"type": "http.response.body", "body": line_safe(body), "more_body": True})


def _start_direct(stream: SSEStream, server_send: Any) -> Optional[Any]:
    """Hand a plain stream's running steps to the engine's output handler (AsyncEngine.stream_directly) when
    the server's connection allows synchronous writes (guards.direct_writer); -> the function that ends it."""
    if stream.direct is None or server_send is None:
        return None
    writer = direct_writer(server_send)
    if writer is None:
        return None
    engine, request_id = stream.direct
    start = getattr(engine, "stream_directly", None)
    return None if start is None else start(request_id, stream.direct_framer(), *writer)


class ChunkFramer:
    """SSE `data:` frames of one response's chunks: the fixed id/object/created/model prefix is encoded once.

    stream_options: `include_usage` adds `"usage": null` to every chunk and a final usage-only chunk;
    `continuous_usage_stats` (vLLM) with include_usage puts the usage so far on every chunk instead (alone, as in
    vLLM, it adds nothing: a client that left usage off gets no usage chunk it does not expect).
    force_usage (vLLM's --enable-force-include-usage): both, whatever the request says.
    """

    def __init__(self, request_id: str, obj: str, created: int, model: str, stream_options: Any,
                 force_usage: bool = False) -> None:
        # stream_options: the request's StreamOptions (or None), or a plain include_usage bool
        if force_usage:
            self.continuous_usage = self.include_usage = True
        elif isinstance(stream_options, bool) or stream_options is None:
            self.continuous_usage, self.include_usage = False, bool(stream_options)
        else:
            self.include_usage = bool(stream_options.include_usage)
            self.continuous_usage = self.include_usage and bool(stream_options.continuous_usage_stats)
        self.head = (b'{"id":' + dumps(request_id) + b',"object":' + dumps(obj) + b',"created":'
                     + str(created).encode() + b',"model":' + dumps(model) + b',"choices":')
        self.tail = b',"usage":null}\n\n' if self.include_usage else b"}\n\n"

    def template(self, before_text: bytes, after_text: bytes = b"") -> tuple[bytes, bytes]:
        """(before, after) the JSON string of a running choice's text: its frame is before + dumps(text) + after
        + end(usage), byte for byte what choices() writes for it. `before_text`: the choice up to the text (e.g.
        b'{"index":0,"text":'); `after_text`: what closes an object the text sits in (chat: the delta's b"}")."""
        return (b"data: " + self.head + b"[" + before_text,
                after_text + b',"logprobs":null,"finish_reason":null,"stop_reason":null}]')

    def end(self, num_prompt: int, num_generated: int) -> bytes:
        """What follows a template's choices: the usage so far with continuous_usage_stats, else the tail."""
        if not self.continuous_usage:
            return self.tail
        return b',"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}\n\n' % (
            num_prompt, num_generated, num_prompt + num_generated)

    def choices(self, choices: list[dict], usage: Optional[dict] = None, top: bytes = b"") -> bytes:
        """top: more top-level members after the choices, e.g. b',"prompt_token_ids":[...]' (vLLM's chat)."""
        if self.continuous_usage and usage is not None:
            return b"data: " + self.head + dumps(choices) + top + b',"usage":' + dumps(usage) + b"}\n\n"
        return b"data: " + self.head + dumps(choices) + top + self.tail

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


async def first_output(request: Request, engine: Any, gen: AsyncIterator, request_ids: list[str]
                       ) -> tuple[Any, asyncio.Task]:
    """(gen's first output, the disconnect watch): the watch starts before the wait, so a client that leaves while
    its request queues aborts it; a failure (a 400 from the engine, a disconnect) stops both."""
    watch = start_disconnect_watch(request, engine, request_ids)
    try:
        return await gen.__anext__(), watch
    except BaseException:
        watch.cancel()
        await gen.aclose()
        raise


async def last_output(gen: AsyncIterator, first: Any, watch: asyncio.Task) -> Any:
    """A non-streamed generation's final output (the rest of gen, from its first), then the watch stops."""
    final = first
    try:
        async for out in gen:
            final = out
    finally:
        watch.cancel()
    return final


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


def usage_dict(num_prompt: int, num_generated: int, cached: Optional[int] = None) -> dict:
    """OpenAI's usage; `cached` (--enable-prompt-tokens-details): the prompt tokens found in the prefix cache."""
    usage = {"prompt_tokens": num_prompt, "completion_tokens": num_generated, "total_tokens": num_prompt + num_generated}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


class CachedTokens:
    """The prompt tokens each prompt of a response found in the prefix cache, as its outputs report them (None
    unless --enable-prompt-tokens-details)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.per_prompt: dict[int, int] = {}

    def note(self, prompt_index: int, output: Any) -> None:
        if self.enabled and output.num_cached_tokens is not None:
            self.per_prompt[prompt_index] = max(self.per_prompt.get(prompt_index, 0), output.num_cached_tokens)

    def total(self) -> Optional[int]:
        return sum(self.per_prompt.values()) if self.enabled else None

    def of(self, prompt_index: int) -> Optional[int]:
        return self.per_prompt.get(prompt_index, 0) if self.enabled else None
