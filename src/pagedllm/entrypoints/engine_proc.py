"""The engine-core process: build EngineCore, say ready, then loop: drain inputs -> step -> send outputs.

Runs in a child started with multiprocessing's 'spawn' context (a clean interpreter: no inherited
threads, locks or CUDA state). Talks to the API process over two ZMQ PUSH/PULL sockets carrying the
typed messages of `messages.py`.

Loop invariant: while requests are unfinished the loop never blocks on the socket (it only drains what
has already arrived, so new HTTP requests join the batch at the very next step); when idle it blocks on
the socket, waking every second to notice a dead parent.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any

from pagedllm.process_utils import one_line, watch_parent

# errors the user can fix, reported as their sentence
_USER_ERRORS = (ValueError, FileNotFoundError, OSError)

logger = logging.getLogger("pagedllm.engine_proc")

_IDLE_POLL_MS = 1000


def run_engine_core(engine_args: Any, input_addr: str, output_addr: str, log_level: str = "info",
                    engine_index: int = 0) -> None:
    """Process entry point (must be importable for the 'spawn' context); `engine_index` is the data-parallel
    replica's number (0 with one engine core)."""
    # The API process handles Ctrl-C and tells us to shut down; a second SIGINT must not kill us mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(), format="%(levelname)s %(asctime)s [engine] %(message)s", datefmt="%H:%M:%S"
    )
    watch_parent(exit_code=0)
    import zmq

    from pagedllm.entrypoints import messages as m

    ctx = zmq.Context(io_threads=1)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 2000)
    out_sock.connect(output_addr)
    enc = m.Encoder()
    try:
        from pagedllm.core.engine_core import EngineCore, freeze_startup_objects

        core = EngineCore(engine_args)
        freeze_startup_objects()  # this process lives as long as its engine: nothing built so far is garbage
    except BaseException as e:  # noqa: BLE001 - any startup failure must reach the user as one line
        logger.debug("engine startup failed", exc_info=True)
        out_sock.send(enc.encode(m.EngineStartupError(message=one_line(e, _USER_ERRORS))))
        out_sock.close()
        ctx.term()
        sys.exit(1)

    out_sock.send(
        enc.encode(
            m.EngineReady(
                model_dir=str(core.model_dir),
                max_model_len=int(core.max_model_len),
                vocab_size=int(core.vocab_size),
                eos_token_ids=[int(t) for t in core.eos_token_ids],
                pid=os.getpid(),
            )
        )
    )
    crashed = False
    structured = getattr(core, "structured", None)
    if structured is not None:
        structured.preload()  # in the background: the first request under a grammar does not load the tokenizer
    try:
        EngineLoop(core, in_sock, out_sock, engine_index).run()
    except Exception as e:  # noqa: BLE001
        crashed = True
        logger.exception("engine core crashed")
        # Tell the API process why (a worker rank died, ...) before the non-zero exit.
        out_sock.send(enc.encode(m.EngineDead(message=one_line(e, _USER_ERRORS), engine_index=engine_index)))
    finally:
        try:
            core.shutdown()
        finally:
            in_sock.close(linger=0)
            out_sock.close()
            ctx.term()
    if crashed:
        os._exit(1)  # at once: library exit handlers must not keep a dead engine's process around


class EngineLoop:
    """The busy loop around one EngineCore (kept separate from process setup so tests can drive it)."""

    def __init__(self, core: Any, in_sock: Any, out_sock: Any, engine_index: int = 0) -> None:
        from pagedllm.entrypoints import messages as m

        self.m = m
        self.engine_index = engine_index
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
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
                    if e.outputs:
                        self.out_sock.send(self.enc.encode(self.m.EngineOutputs(
                            outputs=e.outputs, stats=self._stats(), timestamp=time.time())))
                    for rid in e.request_ids:
                        self.out_sock.send(self.enc.encode(self.m.RequestError(rid, e.message, 500)))
                    self.stats_dirty = True
                    continue
                self._send_request_errors()
                if outputs:
                    self.out_sock.send(
                        self.enc.encode(
                            self.m.EngineOutputs(outputs=outputs, stats=self._stats(), timestamp=time.time(),
                                                 engine_index=self.engine_index)
                        )
                    )
                    self.stats_dirty = False
                else:
                    self.stats_dirty = True

    def _drain(self, zmq: Any) -> None:
        while True:
            try:
                frame = self.in_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(self.dec.decode(frame))
            if not self.running:
                return

    def _handle(self, msg: Any) -> None:
        m = self.m
        if isinstance(msg, m.AddRequest):
            self._add(msg)
        elif isinstance(msg, m.AbortRequests):
            self.core.abort_requests(list(msg.request_ids))
            self.stats_dirty = True
        elif isinstance(msg, m.GetStats):
            self.out_sock.send(self.enc.encode(m.StatsReply(seq=msg.seq, stats=self._stats(),
                                                            engine_index=self.engine_index)))
        elif isinstance(msg, m.Shutdown):
            self.running = False
        elif isinstance(msg, (m.AddLora, m.RemoveLora)):
            self.out_sock.send(self.enc.encode(self._lora(msg)))
            self.stats_dirty = True
        elif isinstance(msg, m.GetDashboard):
            from pagedllm.entrypoints.dashboard.engine_side import dashboard_reply

            self.out_sock.send(self.enc.encode(dashboard_reply(self.core, msg, self.engine_index)))

    def _lora(self, msg: Any) -> Any:
        """Add or remove a LoRA adapter; the reply carries the user's error (400 / 404) or None."""
        m = self.m
        try:
            if isinstance(msg, m.AddLora):
                from pagedllm.lora.request import LoRARequest

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

    def _add(self, msg: Any) -> None:
        from pagedllm.core.engine_core import EngineCoreRequest

        try:
            self.core.add_request(
                EngineCoreRequest(
                    request_id=msg.request_id,
                    prompt_token_ids=list(msg.prompt_token_ids),
                    sampling_params=msg.sampling_params,
                    arrival_time=msg.arrival_time,
                    lora_id=msg.lora_id,
                )
            )
        except ValueError as e:
            self.out_sock.send(self.enc.encode(self.m.RequestError(msg.request_id, str(e), 400)))
            self.stats_dirty = True
        except Exception as e:  # noqa: BLE001 - one bad request must not kill the engine
            logger.exception("add_request failed for %s", msg.request_id)
            self.out_sock.send(self.enc.encode(self.m.RequestError(msg.request_id, one_line(e, _USER_ERRORS), 500)))

    def _send_request_errors(self) -> None:
        pop = getattr(self.core, "pop_request_errors", None)
        for request_id, message in (pop() if pop is not None else []):
            self.out_sock.send(self.enc.encode(self.m.RequestError(request_id, message, 400)))

    def _stats(self) -> Any:
        return self.m.stats_to_msg(self.core.get_stats())

    def _send_stats_outputs(self) -> None:
        self.out_sock.send(self.enc.encode(self.m.EngineOutputs(outputs=[], stats=self._stats(), timestamp=time.time(),
                                                                engine_index=self.engine_index)))
        self.stats_dirty = False
