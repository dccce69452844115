"""AsyncEngine: the API-process side of the engine-core process.

Owns the engine-core child process and the two ZMQ sockets to it. `generate_batches()` sends one typed
request (or n child requests, f"{i}_{parent}") and yields what arrived for it, as lists of RequestOutputs (one
per engine step, never merged: a stream sends each step as its own chunk, and a consumer that fell behind
writes several at once); `generate()` yields them one by one. One output reader (a callback on the output socket's
descriptor, no task) reads everything the engine sends, runs the OutputProcessor (incremental detokenization, stop strings, n>1 aggregation), appends to
each request's pending list (waking its consumer only when it waits), sends aborts for stop-string hits, and
records metrics (token counts once per step). A watcher task notices a dead engine process and fails every
pending request.

Invariant: a request id is in `_parents` from the moment it is sent until its final output was delivered
(or it failed / was aborted); a caller that leaves `generate()` early aborts its engine requests.

One of several API server processes (`client`, --api-server-count > 1): the supervisor started the engine
cores; this process binds its own channels (entrypoints/ipc.py), tags what it sends with its client_index, gets
only its own requests' outputs, and learns of a dead engine core from the supervisor (EngineDead on its output
channel) instead of watching the process.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import shutil
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Container, Optional

import zmq
import zmq.asyncio

from pagedllm import envs
from pagedllm.entrypoints import messages as m
from pagedllm.entrypoints.dp_router import DPRouter
from pagedllm.entrypoints.ipc import DIR_PREFIX, ClientSpec, IPCLayout
from pagedllm.entrypoints.parallel_sampling import fan_out
from pagedllm.process_utils import end_process, socket_directory
from pagedllm.sampling_constraints import tokenize_params
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.async_engine")

_STARTUP_POLL_S = 0.25


class EngineStartupError(RuntimeError):
    """The engine process could not start; str(e) is one line for the user."""


class EngineDeadError(RuntimeError):
    """The engine process is gone (or the server is stopping): a 503 for the client."""

    status = 503


class ClientDisconnected(Exception):
    """The client went away; its request was aborted."""


class RequestRejected(ValueError):
    """The engine refused a request (e.g. it cannot fit the KV pool); `status` is the HTTP status."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass
class _ReqTiming:
    """Per engine-request timing for the latency histograms (API-process clock)."""

    arrival: float
    num_prompt_tokens: int
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    num_generated: int = 0
    engine: int = 0  # the data-parallel engine core serving it
    queued: Optional[float] = None  # seconds waiting in the engine core before first scheduled (its own clock)
    max_tokens: int = 0  # the max_tokens parameter (vllm:request_params_max_tokens)
    samples: Optional["_Samples"] = None  # n > 1: what the request's samples share


@dataclass
class _Samples:
    """The samples of one n > 1 request, for the metrics taken once per request (vllm:request_params_n)."""

    n: int
    left: int
    max_generated: int = 0


@dataclass
class _Parent:
    """One generate() call: what arrived for it and not yet taken (RequestOutputs, or an exception to raise),
    and the future its consumer waits on while there is nothing (push: the handler wakes it once per step)."""

    pending: deque = field(default_factory=deque)
    waiter: Optional[asyncio.Future] = None
    child_ids: list[str] = field(default_factory=list)
    finished: bool = False

    def put(self, item: Any) -> None:
        self.pending.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _DirectSink:
    """A plain stream's running steps, framed and written by the output handler itself (no RequestOutput, no
    wake-up of the stream's writer, no generator hop) while that writer waits with nothing pending and its
    connection takes writes; otherwise the step goes the usual way (pending list, writer), so the order of
    what a client receives never changes. A handler pass's frames of one stream go out in one write at its
    end (flush), as the writer, woken once per pass, would write them."""

    __slots__ = ("parent", "frame", "writable", "write", "buf", "dirty")

    def __init__(self, parent: _Parent, frame: Any, writable: Any, write: Any, dirty: list) -> None:
        self.parent, self.frame, self.writable, self.write, self.dirty = parent, frame, writable, write, dirty
        self.buf: list[bytes] = []

    def __call__(self, text: str, num_tokens: int) -> bool:
        parent = self.parent
        waiter = parent.waiter
        if waiter is None or waiter.done() or parent.pending:
            return False
        buf = self.buf
        if not buf:
            if not self.writable():  # the client is not reading (flow control): the writer waits for it
                return False
            self.dirty.append(self)
        try:
            buf.append(self.frame(text, num_tokens))
        except Exception:  # noqa: BLE001 - the usual path reports it in-band, for this request only
            if not buf:
                self.dirty.remove(self)
            return False
        return True

    def flush(self) -> None:
        buf = self.buf
        self.buf = []
        self.write(buf[0] if len(buf) == 1 else b"".join(buf))


# pyzmq's option and flag enums as plain ints: IntEnum / IntFlag arithmetic and conversion run Python code on every
# call of the output handler's per-pass socket reads.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


class AsyncEngine:
    def __init__(self, engine_args: Any, log_level: str = "info", metrics: Any = None,
                 client: Optional[ClientSpec] = None) -> None:
        self.engine_args = engine_args
        self.log_level = log_level
        self.metrics = metrics
        self.request_logger: Any = None  # request_logger.RequestLogger (--enable-log-requests), set by the server
        self.client = client
        self.client_index = 0 if client is None else client.index
        self.ctx = zmq.asyncio.Context(io_threads=1)
        # Data parallel: one engine-core process per replica, each with its own input channel; one output channel.
        self.num_engines = max(1, int(getattr(engine_args, "data_parallel_size", 1) or 1))
        if client is None:
            self._tmpdir = socket_directory(DIR_PREFIX)
            layout = IPCLayout(self._tmpdir, num_clients=1, num_engines=self.num_engines)
        else:  # the supervisor's directory (it removes it)
            self._tmpdir = None
            layout = client.layout
        self.input_addrs = [layout.input(self.client_index, i) for i in range(self.num_engines)]
        self.input_addr = self.input_addrs[0]
        self.output_addr = layout.output(self.client_index)
        # Several API processes: called with each LoraEvent (another process loaded / unloaded an adapter).
        self.lora_listener: Optional[Any] = None
        self.in_socks = []
        for addr in self.input_addrs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addr)
            self.in_socks.append(sock)
        self.in_sock = self.in_socks[0]
        self._in_sync = [zmq.Socket.shadow(sock.underlying) for sock in self.in_socks]  # non-blocking sends
        self.router = DPRouter(self.num_engines, block_size=int(getattr(engine_args, "block_size", 16) or 16))
        self._engine_of: dict[str, int] = {}  # engine request id -> engine core index
        self.procs: list[multiprocessing.process.BaseProcess] = []
        # A plain (synchronous) socket: the output handler reads it in a reader callback of its descriptor
        # (_start_output_reader); an asyncio socket's own watcher would compete for the descriptor's edges.
        self.out_sock = self.ctx.socket(zmq.PULL, socket_class=zmq.Socket)  # the context tracks it (destroy)
        self.out_sock.setsockopt(zmq.LINGER, 0)
        self.out_sock.bind(self.output_addr)
        self.enc = m.Encoder()
        self.dec = m.output_decoder()
        self.proc: Optional[multiprocessing.process.BaseProcess] = None
        self.ready: Optional[m.EngineReady] = None
        self.tokenizer: Any = None
        self.processor: Any = None
        self.errored = False
        self.dead_reason = ""
        self.dead = asyncio.Event()  # set with errored: what waits for the engine's death awaits it
        self.last_stats = m.SchedulerStatsMsg()
        self._engine_stats = [m.SchedulerStatsMsg() for _ in range(self.num_engines)]
        self._parents: dict[str, _Parent] = {}
        self._engine_to_parent: dict[str, str] = {}
        self._timing: dict[str, _ReqTiming] = {}
        self._stats_seq = itertools.count()
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._dirty: list[_DirectSink] = []  # direct sinks with frames of the current handler pass

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self, startup_timeout_s: Optional[float] = None) -> None:
        """Spawn the engine process and wait for its readiness handshake (or its one-line error). One of several
        API processes spawns nothing: it waits for every engine core's handshake."""
        if self.client is None:
            self.procs = start_engine_cores(self.engine_args, self.log_level, [[a] for a in self.input_addrs],
                                            [self.output_addr])
            self.proc = self.procs[0]
        # transformers takes seconds to import: overlap it with the model load (joined before first use,
        # as two threads importing transformers at once can see a half-initialised module)
        preimport = _preimport_frontend()
        deadline = None if startup_timeout_s is None else time.monotonic() + startup_timeout_s
        num_ready = 0
        while num_ready < self.num_engines:
            frame = await self._recv_during_startup(_STARTUP_POLL_S)
            if frame is not None:
                msg = self.dec.decode(frame)
                if isinstance(msg, m.EngineStartupError):
                    for proc in self.procs:
                        proc.join(5 if proc.exitcode is not None else 0.1)
                    raise EngineStartupError(msg.message)
                if isinstance(msg, m.EngineReady):
                    self.ready = self.ready or msg
                    num_ready += 1
                    if self.metrics is not None:
                        self.metrics.engine_ready(msg.engine_index, msg.max_model_len, msg.cache_config)
                if isinstance(msg, m.EngineDead):  # the supervisor saw an engine core die
                    raise EngineStartupError(f"engine core {msg.engine_index} stopped: {msg.message}")
                continue
            for i, proc in enumerate(self.procs):
                if not proc.is_alive():
                    which = "engine process" if self.num_engines == 1 else f"engine core {i}"
                    raise EngineStartupError(f"the {which} exited with code {proc.exitcode} during startup")
            if deadline is not None and time.monotonic() > deadline:
                for proc in self.procs:
                    proc.kill()
                raise EngineStartupError(f"the engine process did not become ready within {startup_timeout_s} s")
        await asyncio.get_running_loop().run_in_executor(None, preimport.join)
        self._load_frontend()
        loop = asyncio.get_running_loop()
        self._start_output_reader(loop)
        if self.procs:
            self._tasks.append(loop.create_task(self._watch_engine(), name="pagedllm-engine-watch"))

    def _load_frontend(self) -> None:
        from pagedllm.detokenizer import byte_table
        from pagedllm.entrypoints.output_processor import OutputProcessor
        from pagedllm.tokenizer import engine_tokenizer_options, engine_tokenizer_source, get_tokenizer

        assert self.ready is not None
        args = self.engine_args
        self.tokenizer = get_tokenizer(engine_tokenizer_source(args, self.ready.model_dir),
                                       **engine_tokenizer_options(args))
        self.processor = OutputProcessor(self.tokenizer)
        byte_table(self.tokenizer, True)  # built now, not in the first request (skip_special_tokens' default)

    @property
    def max_model_len(self) -> int:
        assert self.ready is not None
        return self.ready.max_model_len

    @property
    def model_dir(self) -> str:
        assert self.ready is not None
        return self.ready.model_dir

    def is_healthy(self) -> bool:
        if self.client is not None:  # the supervisor watches the engine cores and says when one died
            return not self.errored and self.ready is not None
        return not self.errored and bool(self.procs) and all(p.is_alive() for p in self.procs)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        self._stop_output_reader()
        # One of several API processes: the engine cores serve the others still; the supervisor stops them.
        alive = [(i, p) for i, p in enumerate(self.procs) if p.is_alive()]
        for i, _ in alive:
            try:  # never wait here: a core that is exiting has no socket left to take it (PUSH would block);
                # awaited so that "no peer" (Again) is caught here, not logged as a future nobody read
                await self.in_socks[i].send(self.enc.encode(m.Shutdown()), flags=zmq.DONTWAIT)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 5
        while any(p.is_alive() for _, p in alive) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for _, proc in alive:
            end_process(proc)
        for sock in self.in_socks:
            sock.close(0)
        self.out_sock.close(0)
        self.ctx.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ---- requests -------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: Optional[str] = None,
        output_kind: str = "delta",
        lora_request: Any = None,
        cache_salt: Optional[str] = None,
        priority: int = 0,
        prompt_embeds: Any = None,
        data_parallel_rank: Optional[int] = None,
    ) -> AsyncIterator[Any]:
        """Yield RequestOutputs (delta: one per engine step; cumulative: the latest at each wake-up; final_only:
        the last) until the request finishes."""
        batches = self.generate_batches(prompt, prompt_token_ids, params, request_id, output_kind, lora_request,
                                        cache_salt, priority, prompt_embeds, data_parallel_rank)
        try:
            async for batch in batches:
                if output_kind != "delta":
                    yield batch[-1]
                    continue
                for item in batch:
                    yield item
        finally:  # leaving early must abort the request now, not when the collector finds the generator
            await batches.aclose()

    async def generate_batches(
        self,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: Optional[str] = None,
        output_kind: str = "delta",
        lora_request: Any = None,
        cache_salt: Optional[str] = None,
        priority: int = 0,
        prompt_embeds: Any = None,  # a [num_tokens, hidden] tensor; prompt_token_ids: as many placeholders
        data_parallel_rank: Optional[int] = None,  # the engine core to use (X-data-parallel-rank); None: balanced
    ) -> AsyncIterator[list]:
        """Yield every RequestOutput that arrived since the last yield, in order, as a non-empty list, until the
        request finishes (the last list ends with the finished output). An error (engine death, a refused
        request, a disconnect) is raised after the outputs that came before it."""
        if self.errored:
            raise EngineDeadError(self.dead_reason or "the engine process is not running")
        request_id = request_id or uuid.uuid4().hex
        children = fan_out(request_id, tokenize_params(params, self.tokenizer))
        # (n > 1: the engine ids are f"{index}_{id}", which another request's own id may equal)
        taken = [c.request_id for c in children if c.request_id in self._engine_to_parent]
        if request_id in self._parents:
            raise RequestRejected(f"request id {request_id!r} is already running")
        if taken:
            holder = self._engine_to_parent[taken[0]]
            raise RequestRejected(f"request id {request_id!r} needs the engine request id {taken[0]!r}, which the "
                                  f"running request {holder!r} holds (n > 1 runs sample i as '<i>_<request id>')")
        parent = _Parent()
        self._parents[request_id] = parent
        loop = asyncio.get_running_loop()
        pending = parent.pending
        request_logger = self.request_logger
        if request_logger is not None:
            request_logger.log_inputs(request_id, prompt, prompt_token_ids, params, lora_request)
            if request_logger.log_outputs:
                samples: dict[int, tuple[list, list]] = {}  # index -> (text parts, token ids) of delta outputs
            else:
                request_logger = None
        try:
            engine, adds = self._add_children(request_id, parent, prompt, prompt_token_ids, children, output_kind,
                                              lora_request, cache_salt, priority, prompt_embeds, data_parallel_rank)
            await self._send_adds(engine, adds)
            while True:
                if not pending:
                    parent.waiter = loop.create_future()
                    try:
                        await parent.waiter
                    finally:
                        parent.waiter = None
                batch: list = []
                finished = False
                while pending:
                    item = pending[0]
                    if isinstance(item, BaseException):
                        if batch:  # the outputs before it go out first
                            break
                        pending.popleft()
                        raise item
                    pending.popleft()
                    batch.append(item)
                    if item.finished:
                        finished = True
                        break
                # A local flag: fail_pending() marks the parent finished while we are suspended in `yield`,
                # and its error, still pending, must be raised, not skipped.
                if finished:
                    parent.finished = True
                    if request_logger is not None:
                        self._log_outputs(request_logger, request_id, batch, output_kind, samples)
                elif request_logger is not None and output_kind == "delta":
                    _collect(batch, samples)
                yield batch
                if finished:
                    return
        finally:
            self._forget(request_id, abort=not parent.finished, owner=parent)

    @staticmethod
    def _log_outputs(request_logger: Any, request_id: str, batch: list, output_kind: str, samples: dict) -> None:
        """--enable-log-outputs: one line per sample of a finished request, its whole text (deltas joined)."""
        if output_kind == "delta":
            _collect(batch, samples)
        last = {o.index: o for o in batch[-1].outputs}
        for index in sorted(last):
            out = last[index]
            if output_kind == "delta":
                parts, ids = samples.get(index, ([], []))
                text, token_ids = "".join(parts), ids
            else:
                text, token_ids = out.text, list(out.token_ids)
            request_logger.log_output(request_id, text, token_ids, out.finish_reason,
                                      is_streaming=output_kind == "delta")

    async def _send_adds(self, engine: int, adds: list) -> None:
        """Straight into the socket when it takes them now (the usual case: no future, no poller event); what it
        cannot take at once (no peer yet, a full queue) waits in order on the asyncio socket."""
        sync, encode = self._in_sync[engine], self.enc.encode
        for i, add in enumerate(adds):
            try:
                sync.send(encode(add), _NOBLOCK)
            except zmq.Again:
                for rest in adds[i:]:
                    await self.in_socks[engine].send(encode(rest))
                return

    def _add_children(self, request_id: str, parent: _Parent, prompt: Optional[str], prompt_token_ids: list[int],
                      children: list, output_kind: str, lora_request: Any,
                      cache_salt: Optional[str] = None, priority: int = 0,
                      prompt_embeds: Any = None, data_parallel_rank: Optional[int] = None) -> tuple[int, list]:
        """Register the request's engine requests (`children`: fan_out's, one per sample) with the OutputProcessor
        and the bookkeeping; -> (the engine core that gets them, their AddRequest messages)."""
        now = time.monotonic()
        if data_parallel_rank is not None and self.num_engines > 1:
            if not 0 <= data_parallel_rank < self.num_engines:
                raise RequestRejected(f"data_parallel_rank {data_parallel_rank} is out of range [0, "
                                      f"{self.num_engines}).")
        engine = 0
        if self.num_engines > 1:
            engine = self.router.choose(prompt_token_ids, len(children), cache_salt, pinned=data_parallel_rank)
        adds: list[m.AddRequest] = []
        embeds = None
        if prompt_embeds is not None:
            from pagedllm.entrypoints.prompt_embeds import dump_tensor

            embeds = dump_tensor(prompt_embeds)
        samples = _Samples(len(children), len(children)) if len(children) > 1 else None
        for child in children:
            parent.child_ids.append(child.request_id)
            self._engine_to_parent[child.request_id] = request_id
            self._engine_of[child.request_id] = engine
            max_tokens = child.params.max_tokens
            if child.params.pooling is not None:
                max_tokens = 0  # an embedding has no max_tokens parameter (vLLM observes none)
            elif max_tokens is None:  # the engine core's default: the room the prompt leaves
                max_tokens = (self.ready.max_model_len if self.ready else 0) - len(prompt_token_ids)
            self._timing[child.request_id] = _ReqTiming(arrival=now, num_prompt_tokens=len(prompt_token_ids),
                                                        engine=engine, max_tokens=max_tokens, samples=samples)
            # (an embeddings prompt has no tokens to show, nor to decode the output after)
            try:
                self.processor.add_request(child.request_id, prompt, prompt_token_ids if embeds is None else [],
                                           child.params, parent_id=child.parent_id, index=child.index,
                                           output_kind=output_kind)
            except Exception:
                self._unregister(parent)
                raise
            adds.append(m.AddRequest(child.request_id, list(prompt_token_ids), child.params, time.time(),
                                     lora_id=None if lora_request is None else lora_request.lora_int_id,
                                     client_index=self.client_index, cache_salt=cache_salt,
                                     priority=priority,  # (n > 1: every sample has the request's priority)
                                     prompt_embeds=embeds))
        return engine, adds

    def _unregister(self, parent: _Parent) -> None:
        """Undo _add_children's bookkeeping of a request refused before any of it reached an engine core: it is
        neither counted as finished (metrics) nor aborted there."""
        abort = getattr(self.processor, "abort_requests", None)
        for cid in parent.child_ids:
            for table in (self._engine_to_parent, self._engine_of, self._timing):
                table.pop(cid, None)
        if abort is not None:
            abort(parent.child_ids[:-1])  # (the last one is the child the processor refused)
        parent.child_ids.clear()
        parent.finished = True

    def _forget(self, request_id: str, abort: bool, owner: Optional[_Parent] = None) -> None:
        """Drop a request's bookkeeping (abort: its engine requests too). `owner`: only if the id is still this
        parent's: a RequestError or a disconnect forgets a request before its generator ends, and a new request
        may take the id meanwhile; the old generator's late cleanup must not drop the new one (it would wait
        forever, its output processor state left behind to fail the next request with that id as a 500)."""
        parent = self._parents.get(request_id)
        if parent is None or (owner is not None and parent is not owner):
            return
        del self._parents[request_id]
        now = time.monotonic()
        for cid in parent.child_ids:
            self._engine_to_parent.pop(cid, None)
            if abort:
                self._finish_timing(cid, "abort", now)  # counted as finished_reason="abort"
            else:
                self._timing.pop(cid, None)
        if abort:
            self._abort_engine(parent.child_ids)
        for cid in parent.child_ids:
            engine = self._engine_of.pop(cid, None)
            if engine is not None:
                self.router.finished(engine)

    def _abort_engine(self, engine_ids: list[str]) -> None:
        if not engine_ids:
            return
        abort = getattr(self.processor, "abort_requests", None)
        if abort is not None:
            abort(engine_ids)
        if not self.errored and not self._closed:
            # Fire and forget: the abort must go out even if the caller is being cancelled right now.
            self._send_aborts(engine_ids)

    def _send_aborts(self, engine_ids: list[str]) -> None:
        """AbortRequests to the engine core(s) holding these requests."""
        by_engine: dict[int, list[str]] = {}
        for rid in engine_ids:
            by_engine.setdefault(self._engine_of.get(rid, 0), []).append(rid)
        for engine, ids in by_engine.items():
            self.in_socks[engine].send(self.enc.encode(m.AbortRequests(ids, self.client_index)), copy=False)

    def abort_nowait(self, request_id: str) -> None:
        """Abort a running generate() from outside it (e.g. on client disconnect): its KV blocks are freed
        at once and the generator raises ClientDisconnected."""
        parent = self._parents.get(request_id)
        if parent is None:
            return
        self._forget(request_id, abort=not parent.finished)
        parent.finished = True
        parent.put(ClientDisconnected(request_id))

    def stream_directly(self, request_id: str, frame: Any, writable: Any, write: Any) -> Optional[Any]:
        """Let the output handler write a plain stream's running steps itself (_DirectSink): frame(text,
        number of new tokens) -> bytes, writable() -> whether the connection takes a write now, write(bytes).
        -> a function that ends it (call it before the stream's last write), or None when the request is not a
        running plain stream."""
        parent = self._parents.get(request_id)
        if parent is None or parent.finished or self.processor is None:
            return None
        if self.request_logger is not None and self.request_logger.log_outputs:
            return None  # --enable-log-outputs: the text must pass generate_batches, which logs it at the end
        sink = _DirectSink(parent, frame, writable, write, self._dirty)
        if not self.processor.set_sink(request_id, sink):
            return None
        processor = self.processor
        return lambda: processor.clear_sink(request_id, sink)

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    async def add_lora(self, lora_request: Any, announce: bool = False, replaces: Optional[int] = None) -> None:
        """Register an adapter in the engine (read and validated there); RequestRejected with the reason if not.
        `announce` (a run-time load): with several API processes, it returns once every one routes the name.
        `replaces`: the id of the adapter whose name this one takes over (load_inplace)."""
        from pagedllm.lora.resolve import with_local_path

        # A hub id is downloaded here, in a thread, not in the engine core between its steps.
        lora_request = await asyncio.to_thread(with_local_path, lora_request)
        await self._lora_call(lambda seq: m.AddLora(seq, lora_request.lora_name, lora_request.lora_int_id,
                                                    lora_request.lora_path, lora_request.base_model_name,
                                                    client_index=self.client_index, announce=announce,
                                                    replaces=replaces))

    async def remove_lora(self, lora_int_id: int) -> None:
        """Unregister an adapter; requests already running with it finish first."""
        await self._lora_call(lambda seq: m.RemoveLora(seq, lora_int_id, client_index=self.client_index))

    async def _lora_call(self, make: Any) -> None:
        """Send the adapter message to every engine core (data parallel: each has its own worker) and wait for
        all their replies; the first error is the answer."""
        await self._call_every_core(make, m.LoraReply)

    async def admin_call(self, make: Any) -> list:
        """Sleep mode / prefix cache (m.Sleep, m.WakeUp, ...) on every engine core (each has its own workers: all
        must sleep); their AdminReplies, or RequestRejected with the first error."""
        return await self._call_every_core(make, m.AdminReply)

    async def _call_every_core(self, make: Any, reply_type: type) -> list:
        if self.errored or self._closed:
            raise EngineDeadError(self.dead_reason or "the engine process is not running")
        loop = asyncio.get_running_loop()
        seqs = [next(self._stats_seq) for _ in range(self.num_engines)]
        futs = []
        for seq in seqs:
            futs.append(loop.create_future())
            self._stats_waiters[seq] = futs[-1]
        try:
            for engine, seq in enumerate(seqs):
                await self.in_socks[engine].send(self.enc.encode(make(seq)))
            replies = await asyncio.gather(*futs)
        finally:
            for seq in seqs:
                self._stats_waiters.pop(seq, None)
        for reply in replies:
            if not isinstance(reply, reply_type):  # an engine died meanwhile (_fail_all)
                raise EngineDeadError(self.dead_reason or "the engine process is not running")
        for reply in replies:
            if reply.error is not None:
                raise RequestRejected(reply.error, reply.status)
        return replies

    async def get_stats(self, timeout_s: float = 0.5) -> m.SchedulerStatsMsg:
        """Fresh scheduler gauges from the engine (falls back to the last ones seen)."""
        if self.errored or self._closed:
            return self.last_stats
        loop = asyncio.get_running_loop()
        seqs = [next(self._stats_seq) for _ in range(self.num_engines)]
        futs = []
        for engine, seq in enumerate(seqs):
            fut = loop.create_future()
            self._stats_waiters[seq] = fut
            futs.append(fut)
        try:
            for engine, seq in enumerate(seqs):
                await self.in_socks[engine].send(self.enc.encode(m.GetStats(seq, self.client_index)))
            await asyncio.wait_for(asyncio.gather(*futs), timeout_s)
            return self.last_stats
        except asyncio.TimeoutError:
            return self.last_stats
        finally:
            for seq in seqs:
                self._stats_waiters.pop(seq, None)

    @property
    def engine_stats(self) -> list:
        """The newest scheduler stats of each engine core, in engine order."""
        return list(self._engine_stats)

    async def dashboard_replies(self, with_info: bool = False, timeout_s: float = 1.0) -> list:
        """Every engine core's DashboardReply (the KV block states, ...; entrypoints/dashboard), in engine order;
        None for a core that did not answer within timeout_s (it answers between steps)."""
        if self.errored or self._closed:
            return [None] * self.num_engines
        loop = asyncio.get_running_loop()
        seqs = [next(self._stats_seq) for _ in range(self.num_engines)]
        futs = [loop.create_future() for _ in seqs]
        self._stats_waiters.update(zip(seqs, futs))
        try:
            for engine, seq in enumerate(seqs):
                await self.in_socks[engine].send(self.enc.encode(m.GetDashboard(seq, with_info, self.client_index)))
            await asyncio.wait(futs, timeout=timeout_s)
            return [f.result() if f.done() and isinstance(f.result(), m.DashboardReply) else None for f in futs]
        finally:
            for seq in seqs:
                self._stats_waiters.pop(seq, None)

    # ---- background tasks -----------------------------------------------------------------------

    async def _recv_during_startup(self, timeout_s: float) -> Optional[bytes]:
        """The next message from the engine cores within timeout_s, else None (start-up only: polled)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.out_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                if time.monotonic() >= deadline:
                    return None
                await asyncio.sleep(0.01)

    def _start_output_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's outputs in a reader callback of the output socket's file descriptor: no task resumed,
        no future and no poller bookkeeping per engine step (zmq.asyncio's recv costs those)."""
        self._out_sync = self.out_sock
        self._out_fd = self._out_sync.getsockopt(zmq.FD)
        loop.add_reader(self._out_fd, self._on_outputs)
        self._out_loop = loop
        self._on_outputs()  # what arrived before the reader was in place (the descriptor signals edges only)

    def _stop_output_reader(self) -> None:
        loop = getattr(self, "_out_loop", None)
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._out_fd)
        self._out_loop = None

    def _on_outputs(self) -> None:
        """Everything the engine sent, until its socket has nothing more (ZMQ's descriptor is edge-triggered: it
        signals again only after the socket was read empty); a stream's frames of up to 64 messages are written
        together (_flush_direct), as the writer, woken once per pass, would."""
        sock, decode, handle = self._out_sync, self.dec.decode, self._handle_output
        recv, events = sock.recv, sock.getsockopt
        try:
            while events(_EVENTS) & _POLLIN:
                try:
                    for _ in range(64):
                        handle(decode(recv(_NOBLOCK)))
                        if not events(_EVENTS) & _POLLIN:
                            break
                except zmq.Again:
                    pass
                finally:
                    if self._dirty:
                        self._flush_direct()
        except Exception as e:  # noqa: BLE001
            logger.exception("output handler failed")
            self._stop_output_reader()
            self._fail_all(EngineDeadError(f"output handler failed: {e}"))

    def _flush_direct(self) -> None:
        dirty = self._dirty
        for sink in dirty:
            buf = sink.buf  # _DirectSink.flush, inline: one call less per stream and pass
            sink.buf = []
            try:
                sink.write(buf[0] if len(buf) == 1 else b"".join(buf))
            except Exception:  # noqa: BLE001 - one connection's failure is its stream's business, not the handler's
                logger.debug("direct stream write failed", exc_info=True)
        dirty.clear()

    def _handle_output(self, msg: Any) -> None:
        if isinstance(msg, m.EngineOutputs):
            if msg.stats is not None:
                self._update_stats(msg.stats, msg.engine_index)
            tokens = 0  # the step's prompt + generated tokens (vllm:iteration_tokens_total)
            if msg.step_ids:
                if msg.outputs and self.processor is not None and self.processor.has_parents():
                    # n > 1: a parent's children must meet in one process_outputs call (one RequestOutput)
                    tokens = self._process(msg.all_outputs(), msg.engine_index)
                else:
                    tokens = self._process_step(msg.step_ids, msg.step_tokens, msg.step_cached, msg.engine_index)
                    if msg.outputs:
                        tokens += self._process(msg.outputs, msg.engine_index)
            elif msg.outputs:
                tokens = self._process(msg.outputs, msg.engine_index)
            if msg.iteration_tokens is not None:
                tokens = msg.iteration_tokens
            if tokens and self.metrics is not None:
                self.metrics.observe_iteration_tokens(tokens, msg.engine_index)
        elif isinstance(msg, m.RequestError):
            parent_id = self._engine_to_parent.get(msg.request_id)
            if msg.in_step:  # a failed step: counted finished "error", its running siblings (aborted below) "abort"
                now = time.monotonic()
                self._finish_timing(msg.request_id, "error", now)
                for cid in self._parents[parent_id].child_ids if parent_id in self._parents else ():
                    self._finish_timing(cid, "abort", now)
            else:
                self._timing.pop(msg.request_id, None)
            if parent_id is not None and parent_id in self._parents:
                parent = self._parents[parent_id]
                parent.put(RequestRejected(msg.message, msg.status, msg.param))
                # Siblings of a refused child are pointless: abort them (and drop everyone's detokenizer state;
                # aborting the refused id itself is a no-op in the engine).
                parent.finished = True
                self._abort_engine(parent.child_ids)
                self._forget(parent_id, abort=False)
        elif isinstance(msg, m.EngineDead):
            if self.errored and self.client is not None:  # the core said why; the supervisor then saw it exit
                return
            which = "the engine core" if self.num_engines == 1 else f"engine core {msg.engine_index}"
            reason = f"{which} stopped: {msg.message}"
            logger.error("%s; failing %d pending request(s)", reason, len(self._parents))
            self._fail_all(EngineDeadError(reason))
        elif isinstance(msg, (m.LoraReply, m.AdminReply)):
            fut = self._stats_waiters.get(msg.seq)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, m.DashboardReply):
            fut = self._stats_waiters.get(msg.seq)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, m.StatsReply):
            self._update_stats(msg.stats, msg.engine_index)
            fut = self._stats_waiters.get(msg.seq)
            if fut is not None and not fut.done():
                fut.set_result(msg.stats)
        elif isinstance(msg, m.LoraEvent):
            self._lora_event(msg)

    def _lora_event(self, msg: m.LoraEvent) -> None:
        """Another API process loaded or unloaded an adapter: route its name here too, then say so (its client
        gets the answer once every process did)."""
        try:
            if self.lora_listener is not None:
                self.lora_listener(msg)
        finally:
            if not self.errored and not self._closed:
                self.in_socks[msg.engine_index].send(
                    self.enc.encode(m.LoraApplied(msg.origin, msg.seq, self.client_index)), copy=False)

    def _process(self, outputs: list[Any], engine: int = 0) -> int:
        """One engine step's outputs (all from engine core `engine`): timing and metrics, then the
        OutputProcessor, then each request's pending list; -> the step's tokens (_record_timing)."""
        now = time.monotonic()
        # The processor first: a stop string found in the step the engine ended a request ("length") finishes it
        # "stop" for the client, and so in vllm:request_success (it was counted "length").
        request_outputs, to_abort = self.processor.process_outputs(outputs, now)
        step_tokens = self._record_timing(outputs, now, engine, self.processor.stopped_by_string)
        self._deliver(request_outputs, to_abort, now)
        return step_tokens

    def _process_step(self, ids: list[str], tokens: list[int], cached: list[int], engine: int = 0) -> int:
        """_process for a step's columns (EngineOutputs.step_ids: running requests, one new token each): the
        timing of _record_timing for them, then OutputProcessor.process_step."""
        now = time.monotonic()
        timing = self._timing
        new_tokens = prompt_tokens = 0
        gaps: list[float] = []
        for rid in ids:
            t = timing.get(rid)
            if t is not None:
                prompt_tokens += self._count_tokens(t, 1, now, gaps)
                new_tokens += 1
        if new_tokens and self.metrics is not None:
            self.metrics.add_generation_tokens(new_tokens, engine)
            self.metrics.observe_gaps(gaps, engine)
        self._deliver(*self.processor.process_step(ids, tokens, cached, now), now)
        return new_tokens + prompt_tokens

    def _deliver(self, request_outputs: list, to_abort: list, now: float) -> None:
        """The OutputProcessor's results to each request's pending list; stop-string aborts to the engine."""
        parents = self._parents
        for ro in request_outputs:
            parent = parents.get(ro.request_id)
            if parent is not None:
                parent.put(ro)
        if to_abort:
            to_abort = list(to_abort)
            if not self.errored:
                self._send_aborts(to_abort)
            for rid in to_abort:
                self._finish_timing(rid, "stop", now)

    def _record_timing(self, outputs: list[Any], now: float, engine: int, stopped: Container[str] = ()) -> int:
        """-> the step's tokens as vLLM counts them per iteration: those generated, plus the prompts of the
        requests whose first token came. `stopped`: the finished ones a stop string ended (finish_reason "stop")."""
        timing, metrics = self._timing, self.metrics
        new_tokens = prompt_tokens = 0
        gaps: list[float] = []
        for out in outputs:
            t = timing.get(out.request_id)
            if t is None:
                continue
            n_new = len(out.new_token_ids)
            if out.queued_s is not None:
                t.queued = out.queued_s
            if n_new:
                prompt_tokens += self._count_tokens(t, n_new, now, gaps)
                new_tokens += n_new
            elif out.pooled is not None and t.first_token is None:
                # an embedding's result is its first output: its prompt and TTFT count, as vLLM counts them
                prompt_tokens += self._count_tokens(t, 0, now, gaps)
            if out.finish_reason is not None:
                self._finish_timing(out.request_id, "stop" if out.request_id in stopped else out.finish_reason, now)
        if new_tokens and metrics is not None:  # one counter update per step, not per request
            metrics.add_generation_tokens(new_tokens, engine)
            metrics.observe_gaps(gaps, engine)
        return new_tokens + prompt_tokens

    def _count_tokens(self, t: "_ReqTiming", n_new: int, now: float, gaps: list[float]) -> int:
        """A request's timing after n_new (> 0) tokens arrived at `now`: its first token observed once, the gap
        since its previous tokens appended to `gaps` otherwise; -> its prompt's tokens with its first token
        (counted in that step, as vLLM does), else 0."""
        t.num_generated += n_new
        if t.first_token is None:
            t.first_token = t.last_token = now
            if self.metrics is not None:
                self.metrics.observe_first_token(now - t.arrival, t.num_prompt_tokens, t.engine)
            return t.num_prompt_tokens
        gaps.append(now - t.last_token)
        t.last_token = now
        return 0

    def _finish_timing(self, engine_id: str, reason: str, now: float) -> None:
        t = self._timing.pop(engine_id, None)
        if t is None or self.metrics is None:
            return
        tpot = None
        if t.first_token is not None and t.last_token is not None and t.num_generated > 1:
            tpot = (t.last_token - t.first_token) / (t.num_generated - 1)
        phases = None
        if t.queued is not None and t.first_token is not None:
            # (queue, prefill, decode): prefill from the first scheduling (arrival + queue) to the first token
            phases = (t.queued, max(0.0, t.first_token - t.arrival - t.queued), (t.last_token or now) - t.first_token)
        samples: Optional[tuple[int, int]] = (1, t.num_generated)
        group = t.samples
        if group is not None:  # n > 1: once, with the last sample to finish
            group.left -= 1
            group.max_generated = max(group.max_generated, t.num_generated)
            samples = (group.n, group.max_generated) if group.left == 0 else None
        self.metrics.observe_finished(reason, now - t.arrival, tpot, t.engine, num_prompt=t.num_prompt_tokens,
                                      num_generated=t.num_generated, phases=phases, max_tokens=t.max_tokens,
                                      samples=samples)

    def _update_stats(self, stats: m.SchedulerStatsMsg, engine: int = 0) -> None:
        prev, self._engine_stats[engine] = self._engine_stats[engine], stats
        self.last_stats = stats if self.num_engines == 1 else _sum_stats(self._engine_stats)
        if self.metrics is not None:
            self.metrics.update_scheduler_stats(stats, prev, engine)

    async def _watch_engine(self) -> None:
        """Wakes when an engine process exits (its sentinel becomes readable): an idle API process spends
        nothing on it; polled where the loop cannot watch a file descriptor."""
        assert self.procs
        loop = asyncio.get_running_loop()
        exited: asyncio.Future = loop.create_future()
        watched = []
        try:
            for i, proc in enumerate(self.procs):
                loop.add_reader(proc.sentinel, lambda i=i: exited.done() or exited.set_result(i))
                watched.append(proc.sentinel)
        except (NotImplementedError, OSError, ValueError):
            for fd in watched:
                loop.remove_reader(fd)
            watched = []
        try:
            while not exited.done():
                if watched:
                    await exited
                    break
                await asyncio.sleep(0.2)
                for i, proc in enumerate(self.procs):
                    if not proc.is_alive():
                        exited.set_result(i)
                        break
        finally:
            for fd in watched:
                loop.remove_reader(fd)
        i = exited.result()
        await asyncio.sleep(0.2)  # its EngineDead message (if it sent one) says more
        if self.errored:
            return
        proc = self.procs[i]
        proc.join(1.0)  # the sentinel fires as it exits: its exit code follows
        which = "the engine process" if self.num_engines == 1 else f"engine core {i}"
        reason = f"{which} died (exit code {proc.exitcode})"
        logger.error("%s; failing %d pending request(s)", reason, len(self._parents))
        self._fail_all(EngineDeadError(reason))

    def fail_pending(self, reason: str) -> None:
        """End every running request now with a 503 (server shutdown): streams close with an error event
        and [DONE] instead of being cut off, and the engine frees their blocks."""
        for request_id in list(self._parents):
            parent = self._parents[request_id]
            self._forget(request_id, abort=not parent.finished)
            parent.finished = True
            parent.put(EngineDeadError(reason))

    def _fail_all(self, err: BaseException) -> None:
        self.errored = True
        self.dead_reason = str(err)
        self.dead.set()
        for parent in list(self._parents.values()):
            parent.finished = True
            parent.put(err)
        for fut in self._stats_waiters.values():
            if not fut.done():
                fut.set_result(self.last_stats)


def start_engine_cores(engine_args: Any, log_level: str, input_addrs: list[list[str]],
                       output_addrs: list[str]) -> list[multiprocessing.process.BaseProcess]:
    """Spawn one engine-core process per data-parallel replica; core i connects to input_addrs[i] (one per API
    process, and the supervisor's control channel) and to every output address (one per API process)."""
    from pagedllm.entrypoints.engine_proc import run_engine_core

    spawn = multiprocessing.get_context("spawn")
    num_engines = len(input_addrs)
    procs = []
    for i in range(num_engines):
        args = replica_args(engine_args, i)
        inputs = input_addrs[i][0] if len(input_addrs[i]) == 1 else input_addrs[i]
        outputs = output_addrs[0] if len(output_addrs) == 1 else output_addrs
        # A spawned child takes os.environ as it is at start(): its own variables are set for that moment.
        with envs.environ_set({**envs.child_vars(), **replica_devices(engine_args, i)}):
            proc = spawn.Process(
                target=run_engine_core,
                args=(args, inputs, outputs, log_level, i),
                name=f"pagedllm-engine-core-{i}" if num_engines > 1 else "pagedllm-engine-core",
                daemon=True,
            )
            proc.start()
        procs.append(proc)
    return procs


def replica_args(engine_args: Any, index: int) -> Any:
    """The engine args of data-parallel replica `index`: one engine core each (same seed: equal outputs)."""
    if getattr(engine_args, "data_parallel_size", 1) in (None, 1):
        return engine_args
    return dataclasses.replace(engine_args, data_parallel_size=1)


def replica_devices(engine_args: Any, index: int) -> dict[str, str]:
    """The CUDA_VISIBLE_DEVICES of replica `index` (its own GPUs, tensor x pipeline ranks each); {} when the
    engine has one replica or runs on the CPU."""
    n = getattr(engine_args, "data_parallel_size", 1) or 1
    if n == 1 or getattr(engine_args, "device", "auto") == "cpu":
        return {}
    per = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    old = envs.CUDA_VISIBLE_DEVICES
    visible = old.split(",") if old else [str(i) for i in range(n * per)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(visible[index * per:(index + 1) * per])}


def _sum_stats(stats: list[m.SchedulerStatsMsg]) -> m.SchedulerStatsMsg:
    """The server's totals over data-parallel engine cores (KV usage: the mean)."""
    return m.SchedulerStatsMsg(
        num_running=sum(s.num_running for s in stats), num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats))


def _preimport_frontend() -> threading.Thread:
    def work() -> None:
        try:
            import transformers  # noqa: F401

            from pagedllm.entrypoints import output_processor  # noqa: F401
            from pagedllm.tokenizer import get_tokenizer  # noqa: F401
        except Exception:  # noqa: BLE001 - the real import later reports any problem
            pass

    thread = threading.Thread(target=work, name="pagedllm-preimport", daemon=True)
    thread.start()
    return thread


def _collect(batch: list, samples: dict) -> None:
    """Delta outputs' text and token ids, per sample index (--enable-log-outputs)."""
    for ro in batch:
        for out in ro.outputs:
            parts, ids = samples.setdefault(out.index, ([], []))
            parts.append(out.text)
            ids.extend(out.token_ids)
