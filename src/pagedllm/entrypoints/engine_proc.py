"""The engine-core process: build EngineCore, say ready, then loop: drain inputs -> step -> send outputs.

Runs in a child started with multiprocessing's 'spawn' context (a clean interpreter: no inherited
threads, locks or CUDA state). Talks to the API process over two ZMQ PUSH/PULL sockets carrying the
typed messages of `messages.py`. With several API server processes (`--api-server-count`) it has one output
socket per API process and one input socket connected to all of them (and to the supervisor's control
channel): each request's outputs go back to the process that sent it (its `client_index`).

Loop invariant: while requests are unfinished the loop never blocks on the socket (it only drains what
has already arrived, so new HTTP requests join the batch at the very next step); when idle it blocks on
the socket, waking every second to notice a dead parent.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
from typing import Any, Union

from pagedllm.entrypoints.ipc import owned_directory
from pagedllm.process_utils import one_line, set_process_name, watch_parent

# errors the user can fix, reported as their sentence
_USER_ERRORS = (ValueError, FileNotFoundError, OSError)

logger = logging.getLogger("pagedllm.engine_proc")

_IDLE_POLL_MS = 1000


def run_engine_core(engine_args: Any, input_addr: Union[str, list[str]], output_addr: Union[str, list[str]],
                    log_level: str = "info", engine_index: int = 0) -> None:
    """Process entry point (must be importable for the 'spawn' context); `engine_index` is the data-parallel
    replica's number (0 with one engine core). A list of input addresses: one input socket connected to each;
    a list of output addresses: one output socket per API server process, in client_index order."""
    # The API process handles Ctrl-C and tells us to shut down; a second SIGINT must not kill us mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_process_name(f"pagedllm-core-{engine_index}")
    logging.basicConfig(
        level=log_level.upper(), format="%(levelname)s %(asctime)s [engine] %(message)s", datefmt="%H:%M:%S"
    )
    first = input_addr if isinstance(input_addr, str) else input_addr[0]
    leftovers = owned_directory(first)  # its owner killed, the channels' directory would stay behind
    watch_parent(exit_code=0, leftovers=leftovers)
    import zmq

    from pagedllm.entrypoints import messages as m

    ctx = zmq.Context(io_threads=1)
    in_sock = ctx.socket(zmq.PULL)
    for addr in [input_addr] if isinstance(input_addr, str) else input_addr:
        in_sock.connect(addr)
    out_socks = []
    for addr in [output_addr] if isinstance(output_addr, str) else output_addr:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(addr)
        out_socks.append(sock)
    enc = m.Encoder()

    def broadcast(msg: Any) -> None:
        frame = enc.encode(msg)
        for sock in out_socks:
            sock.send(frame)

    def close() -> None:
        in_sock.close(linger=0)
        for sock in out_socks:
            sock.close()
        ctx.term()

    try:
        from pagedllm.core.engine_core import EngineCore, freeze_startup_objects

        core = EngineCore(engine_args)
        freeze_startup_objects()  # this process lives as long as its engine: nothing built so far is garbage
    except BaseException as e:  # noqa: BLE001 - any startup failure must reach the user as one line
        logger.debug("engine startup failed", exc_info=True)
        broadcast(m.EngineStartupError(message=one_line(e, _USER_ERRORS)))
        close()
        sys.exit(1)

    broadcast(
        m.EngineReady(
            model_dir=str(core.model_dir),
            max_model_len=int(core.max_model_len),
            vocab_size=int(core.vocab_size),
            eos_token_ids=[int(t) for t in core.eos_token_ids],
            pid=os.getpid(),
            hidden_size=int(core.hidden_size),
            classifier_labels=core.classifier_labels,
            token_labels=core.token_labels,
            pooling_tasks=list(core.pooling_tasks),
            step_pooling=core.step_pooling,
            architecture=core.architecture,
            pad_token_id=core.pad_token_id if isinstance(core.pad_token_id, int) else None,
            engine_index=engine_index,
            cache_config=core.cache_config_info(),
        )
    )
    crashed = False
    structured = getattr(core, "structured", None)
    if structured is not None:
        structured.preload()  # in the background: the first request under a grammar does not load the tokenizer
    try:
        loop = EngineLoop(core, in_sock, out_socks[0], engine_index, out_socks=out_socks)
        loop.run()
        if leftovers and os.getppid() != loop.parent_pid:  # the owner was killed (see watch_parent)
            shutil.rmtree(leftovers, ignore_errors=True)
    except Exception as e:  # noqa: BLE001
        crashed = True
        logger.exception("engine core crashed")
        # Tell the API process(es) why (a worker rank died, ...) before the non-zero exit.
        broadcast(m.EngineDead(message=one_line(e, _USER_ERRORS), engine_index=engine_index))
    finally:
        try:
            core.shutdown()
        finally:
            close()
    if crashed:
        os._exit(1)  # at once: library exit handlers must not keep a dead engine's process around


class EngineLoop:
    """The busy loop around one EngineCore (kept separate from process setup so tests can drive it).

    With several API server processes (`out_socks` has one socket per client_index) it remembers which process
    sent each running request and sends each step's outputs as one message per process that has some; with one,
    every output goes to `out_sock` as before and nothing is looked up per output."""

    def __init__(self, core: Any, in_sock: Any, out_sock: Any, engine_index: int = 0,
                 out_socks: Any = None) -> None:
        from pagedllm.entrypoints import messages as m

        self.m = m
        self.engine_index = engine_index
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.out_socks = list(out_socks) if out_socks else [out_sock]
        self.multi = len(self.out_socks) > 1
        self._client_of: dict[str, int] = {}  # running request id -> client_index (several API processes only)
        self._prompt_len: dict[str, int] = {}  # and its prompt's length until its first token (iteration_tokens)
        self._gone: set[int] = set()  # API processes that died: nothing more is sent to them
        # Run-time LoRA loads / unloads waiting for the other API processes: (origin, seq) -> (waiting, reply)
        self._lora_waits: dict[tuple[int, int], tuple[set[int], Any]] = {}
        self.enc = m.Encoder()
        self.dec = m.input_decoder()
        self.parent_pid = os.getppid()
        self.running = True
        # Set when the queue changed without a step (abort, refused add): send fresh gauges when idle.
        self.stats_dirty = False

    def run(self) -> None:
        import zmq

        from pagedllm.core.errors import RequestStepError

        while self.running:
            if not self.core.has_unfinished_requests():
                if self.stats_dirty:
                    self._send_stats_outputs()
                # Idle: block until something arrives (waking now and then to check the parent lives).
                if not self.in_sock.poll(_IDLE_POLL_MS):
                    if os.getppid() != self.parent_pid:
                        logger.info("API process is gone; engine core exits")
                        return
                    check = getattr(self.core, "check_health", None)
                    if check is not None:
                        check()  # a dead worker rank stops the engine even when no request runs
                    continue
            self._drain(zmq)
            if not self.running:
                return
            if self.core.has_unfinished_requests():
                try:
                    outputs = self.core.step()
                except RequestStepError as e:  # one request's fault: fail it, keep serving the rest
                    owners = [(rid, self._owner(rid)) for rid in e.request_ids]  # before their outputs forget them
                    if e.outputs:
                        self._send_outputs(e.outputs)
                    for rid, client in owners:
                        self._client_of.pop(rid, None)
                        self._prompt_len.pop(rid, None)
                        self._send_to(client, self.m.RequestError(rid, e.message, e.status, in_step=True))
                    self.stats_dirty = True
                    continue
                self._send_request_errors()
                if outputs:
                    self._send_outputs(outputs)
                    self.stats_dirty = False
                else:
                    self.stats_dirty = True

    def _send_outputs(self, outputs: list) -> None:
        m = self.m
        if not self.multi:
            self.out_sock.send(self.enc.encode(m.step_outputs(outputs, self._stats(), time.time(),
                                                              self.engine_index)))
            return
        by_client: dict[int, list] = {}
        client_of, prompt_len = self._client_of, self._prompt_len
        tokens = 0  # the step's, as vLLM counts them: those generated, plus the prompts of first tokens
        for out in outputs:
            client = client_of.pop(out.request_id, -1) if out.finish_reason is not None \
                else client_of.get(out.request_id, -1)
            if client >= 0:  # -1: aborted meanwhile, nobody waits for it (nor counts its tokens)
                by_client.setdefault(client, []).append(out)
                tokens += len(out.new_token_ids)
                if out.new_token_ids or out.pooled is not None:
                    tokens += prompt_len.pop(out.request_id, 0)
            if out.finish_reason is not None:
                prompt_len.pop(out.request_id, None)
        stats, now = self._stats(), time.time()
        for client, outs in by_client.items():
            msg = m.step_outputs(outs, stats, now, self.engine_index)
            msg.iteration_tokens, tokens = tokens, 0  # one sample per step: with the first process's part
            self._send_to(client, msg)

    def _owner(self, request_id: str, forget: bool = False) -> int:
        """The client_index that sent a running request (0 with one API process; -1: unknown)."""
        if not self.multi:
            return 0
        if forget:
            self._prompt_len.pop(request_id, None)
        return self._client_of.pop(request_id, -1) if forget else self._client_of.get(request_id, -1)

    def _send_to(self, client: int, msg: Any) -> None:
        if client < 0 or client in self._gone:
            return
        self.out_socks[client].send(self.enc.encode(msg))

    def _broadcast(self, msg: Any) -> None:
        frame = self.enc.encode(msg)
        for client, sock in enumerate(self.out_socks):
            if client not in self._gone:
                sock.send(frame)

    def _drain(self, zmq: Any) -> None:
        while True:
            try:
                frame = self.in_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self.dec.decode(frame)
            except Exception as e:  # noqa: BLE001 (msgspec's DecodeError / ValidationError) - not the loop's end
                self._undecodable(frame, e)
                continue
            self._handle(msg)
            if not self.running:
                return

    def _undecodable(self, frame: bytes, error: Exception) -> None:
        """A message whose fields do not fit their types (a request field the API process let through unchecked):
        refuse that request alone with a 400; anything else is logged and dropped."""
        import msgspec

        try:
            raw = msgspec.msgpack.decode(frame)
        except Exception:  # noqa: BLE001 - not even msgpack: nothing to answer
            raw = None
        if isinstance(raw, dict) and raw.get("type") == "add" and isinstance(raw.get("request_id"), str):
            client = raw.get("client_index", 0)
            client = client if isinstance(client, int) and 0 <= client < len(self.out_socks) else 0
            logger.warning("request %s refused: the engine could not read it (%s)", raw["request_id"], error)
            why = one_line(error, (msgspec.ValidationError,))
            self._send_to(client, self.m.RequestError(
                raw["request_id"], f"The request has a field the engine cannot take: {why}", 400))
            self.stats_dirty = True
            return
        logger.error("dropped a message the engine could not read: %s", one_line(error, ()))

    def _handle(self, msg: Any) -> None:
        m = self.m
        if isinstance(msg, m.AddRequest):
            self._add(msg)
        elif isinstance(msg, m.AbortRequests):
            ids = list(dict.fromkeys(msg.request_ids))  # an id twice: aborted (and forgotten) once
            if self.multi:  # only the sender's own requests: another process may use the same id
                ids = [rid for rid in ids if self._client_of.get(rid) == msg.client_index]
                for rid in ids:
                    del self._client_of[rid]
                    self._prompt_len.pop(rid, None)
            self.core.abort_requests(ids)
            self.stats_dirty = True
        elif isinstance(msg, m.GetStats):
            self._send_to(msg.client_index, m.StatsReply(seq=msg.seq, stats=self._stats(),
                                                         engine_index=self.engine_index))
        elif isinstance(msg, m.Shutdown):
            self.running = False
        elif isinstance(msg, (m.AddLora, m.RemoveLora)):
            self._lora_message(msg)
            self.stats_dirty = True
        elif isinstance(msg, m.GetDashboard):
            from pagedllm.entrypoints.dashboard.engine_side import dashboard_reply

            self._send_to(msg.client_index, dashboard_reply(self.core, msg, self.engine_index))
        elif isinstance(msg, m.LoraApplied):
            self._lora_applied(msg.origin, msg.seq, msg.client_index)
        elif isinstance(msg, m.ClientGone):
            self._client_gone(msg.client_index)
        elif isinstance(msg, (m.Sleep, m.WakeUp, m.IsSleeping, m.ResetPrefixCache)):
            self._send_to(msg.client_index, self._admin(msg))
            self.stats_dirty = True

    def _client_gone(self, client: int) -> None:
        """An API process died: abort what it was waiting for and stop sending to it (its socket has no reader;
        the messages would pile up until a send blocks the loop)."""
        self._gone.add(client)
        ids = [rid for rid, c in self._client_of.items() if c == client]
        for rid in ids:
            del self._client_of[rid]
            self._prompt_len.pop(rid, None)
        if ids:
            logger.warning("API server %d is gone: aborting its %d request(s)", client, len(ids))
            self.core.abort_requests(ids)
            self.stats_dirty = True
        for key in list(self._lora_waits):
            self._lora_applied(key[0], key[1], client)

    def _lora_message(self, msg: Any) -> None:
        m = self.m
        reply = self._lora(msg)
        others = [c for c in range(len(self.out_socks)) if c != msg.client_index and c not in self._gone]
        announce = self.multi and reply.error is None and others and (
            isinstance(msg, m.RemoveLora) or msg.announce)
        if not announce:
            self._send_to(msg.client_index, reply)
            return
        # The other API processes route the name (or stop routing it) before the loading one answers its client.
        if isinstance(msg, m.AddLora):
            event = m.LoraEvent(origin=msg.client_index, seq=msg.seq, added=True, lora_int_id=msg.lora_int_id,
                                lora_name=msg.lora_name, lora_path=msg.lora_path,
                                base_model_name=msg.base_model_name, engine_index=self.engine_index)
        else:
            event = m.LoraEvent(origin=msg.client_index, seq=msg.seq, added=False, lora_int_id=msg.lora_int_id,
                                engine_index=self.engine_index)
        self._lora_waits[(msg.client_index, msg.seq)] = (set(others), reply)
        for client in others:
            self._send_to(client, event)

    def _lora_applied(self, origin: int, seq: int, client: int) -> None:
        wait = self._lora_waits.get((origin, seq))
        if wait is None:
            return
        waiting, reply = wait
        waiting.discard(client)
        if not waiting:
            del self._lora_waits[(origin, seq)]
            self._send_to(origin, reply)

    def _lora(self, msg: Any) -> Any:
        """Add or remove a LoRA adapter; the reply carries the user's error (400 / 404) or None."""
        m = self.m
        try:
            if isinstance(msg, m.AddLora):
                from pagedllm.lora.request import LoRARequest

                if self.multi and msg.announce:
                    # Two API processes may load one name at once: the engine core is where they meet.
                    owner = self.core.loras.id_of_name(msg.lora_name)
                    if owner is not None and owner not in (msg.lora_int_id, msg.replaces):
                        return m.LoraReply(msg.seq, f"The lora adapter '{msg.lora_name}' has already been loaded.",
                                           400)
                self.core.add_lora(LoRARequest(lora_name=msg.lora_name, lora_int_id=msg.lora_int_id,
                                               lora_path=msg.lora_path, base_model_name=msg.base_model_name))
            elif not self.core.remove_lora(msg.lora_int_id):
                return m.LoraReply(msg.seq, f"LoRA adapter id {msg.lora_int_id} is not loaded.", 404)
        except ValueError as e:
            return m.LoraReply(msg.seq, str(e), 400)
        except Exception as e:  # noqa: BLE001 - a broken adapter file must not kill the engine
            logger.exception("LoRA %s failed", type(msg).__name__)
            return m.LoraReply(msg.seq, one_line(e, _USER_ERRORS), 500)
        return m.LoraReply(msg.seq)

    def _admin(self, msg: Any) -> Any:
        """Sleep mode and the prefix cache; the reply carries the user's error (400, 409: requests in flight)."""
        from pagedllm.core.engine_core import EngineBusy

        m, core = self.m, self.core
        try:
            if isinstance(msg, m.Sleep):
                core.sleep(msg.level)
                value = True
            elif isinstance(msg, m.WakeUp):
                core.wake_up(msg.tags)
                value = core.is_sleeping()
            elif isinstance(msg, m.IsSleeping):
                value = core.is_sleeping()
            else:
                value = core.reset_prefix_cache()
        except EngineBusy as e:
            return m.AdminReply(msg.seq, str(e), 409, engine_index=self.engine_index)
        except ValueError as e:
            return m.AdminReply(msg.seq, str(e), 400, engine_index=self.engine_index)
        except Exception as e:  # noqa: BLE001 - reported to the caller; a broken rank fails the next step as usual
            logger.exception("%s failed", type(msg).__name__)
            return m.AdminReply(msg.seq, one_line(e, _USER_ERRORS), 500, engine_index=self.engine_index)
        return m.AdminReply(msg.seq, value=value, engine_index=self.engine_index)

    def _add(self, msg: Any) -> None:
        from pagedllm.core.engine_core import EngineCoreRequest
        from pagedllm.entrypoints.prompt_embeds import load_tensor

        try:
            self.core.add_request(
                EngineCoreRequest(
                    request_id=msg.request_id,
                    prompt_token_ids=list(msg.prompt_token_ids),
                    sampling_params=msg.sampling_params,
                    arrival_time=msg.arrival_time,
                    lora_id=msg.lora_id,
                    cache_salt=msg.cache_salt,
                    priority=msg.priority,
                    prompt_embeds=None if msg.prompt_embeds is None else load_tensor(msg.prompt_embeds),
                )
            )
        except ValueError as e:  # a structured-output spec's error names the request field (e.param)
            from pagedllm.core.engine_core import EngineSleeping

            status = 503 if isinstance(e, EngineSleeping) else 400  # asleep: the server is fine, try again later
            self._send_to(msg.client_index, self.m.RequestError(msg.request_id, str(e), status,
                                                                getattr(e, "param", None)))
            self.stats_dirty = True
            return
        except Exception as e:  # noqa: BLE001 - one bad request must not kill the engine
            logger.exception("add_request failed for %s", msg.request_id)
            self._send_to(msg.client_index, self.m.RequestError(msg.request_id, one_line(e, _USER_ERRORS), 500))
            return
        if self.multi:
            self._client_of[msg.request_id] = msg.client_index
            self._prompt_len[msg.request_id] = len(msg.prompt_token_ids)

    def _send_request_errors(self) -> None:
        pop = getattr(self.core, "pop_request_errors", None)
        for request_id, message, param in (pop() if pop is not None else []):
            self._send_to(self._owner(request_id, forget=True), self.m.RequestError(request_id, message, 400, param))

    def _stats(self) -> Any:
        return self.m.stats_to_msg(self.core.get_stats())

    def _send_stats_outputs(self) -> None:
        self._broadcast(self.m.EngineOutputs(outputs=[], stats=self._stats(), timestamp=time.time(),
                                             engine_index=self.engine_index))
        self.stats_dirty = False
