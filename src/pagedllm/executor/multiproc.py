"""The multi-process executor: one worker process per rank (tensor x pipeline), driven from the engine core.

Plans go to every rank once per step over one ZMQ ROUTER socket (IPC on one node, TCP across nodes), pickled
once and sent to each rank's DEALER; tensors move only between the workers, over torch.distributed (gloo on
CPU, NCCL on GPU). The output rank (the first of the last pipeline stage) sends the sampled tokens back.
With pipeline parallelism the earlier stages get those tokens with the next plan they are sent.

Failures: a worker process that exits, or sends an error (its collective timed out because a peer died or
hangs), stops the engine with a RuntimeError naming the rank; nothing waits forever (a step that produces no
output within the collective timeout fails too). Remote ranks that never join fail the start in one sentence.
A RequestStepError (some requests' fault, e.g. an adapter that cannot be read again) is not a rank failure: every
rank skips that step, and it is raised here for the engine core to fail those requests alone.
"""
from __future__ import annotations

import copy
import logging
import os
import pickle
import shutil
import subprocess
import sys
import time
from typing import Any, Optional

from pagedllm import envs
from pagedllm.core.batch_plan import BatchPlan, ModelOutput
from pagedllm.core.errors import RequestStepError
from pagedllm.executor.parallel_config import ParallelLayout, check_layout, layout_from_args
from pagedllm.executor.worker_proc import RANK_DEFAULTS, WorkerSpec, dumps
from pagedllm.process_utils import socket_directory

logger = logging.getLogger("pagedllm.executor")

_POLL_MS = 50


class WorkerFailed(RuntimeError):
    """A worker rank died, hung past the collective timeout, or raised; str() names the rank."""


def collective_timeout_s() -> float:
    return envs.PAGEDLLM_DIST_TIMEOUT_S


def join_timeout_s() -> float:
    return envs.PAGEDLLM_NODE_JOIN_TIMEOUT_S


def prepare_model(args: Any) -> tuple[str, Any]:
    """Resolve (and for GGUF convert, once) the model before the ranks start, and read its config."""
    from pagedllm.models.loader import engine_hf_config, prepare_model_dir, resolve_model_path

    path = resolve_model_path(args.model, args.revision, args.download_dir, getattr(args, "hf_token", None))
    model_dir = prepare_model_dir(path, args.load_format)
    return model_dir, engine_hf_config(args, model_dir)  # the ranks read the same (Worker -> engine_hf_config)


def check_devices(args: Any, layout: ParallelLayout, hf_config: Any) -> None:
    import torch

    from pagedllm.worker.worker import resolve_device

    device = resolve_device(args.device)
    check_layout(layout, hf_config, device.type, torch.cuda.device_count() if device.type == "cuda" else 0)


def spawn_local_workers(args: Any, layout: ParallelLayout, driver_addr: str, spec_dir: str,
                        log_level: str = "INFO") -> dict[int, subprocess.Popen]:
    """Start this node's ranks as fresh interpreters (the engine core may itself be a daemon process, which
    multiprocessing forbids to have children)."""
    ranks = layout.node_ranks()
    threads = max(1, (os.cpu_count() or 1) // len(ranks))
    procs: dict[int, subprocess.Popen] = {}
    for local_rank, rank in enumerate(ranks):
        spec = WorkerSpec(rank=rank, local_rank=local_rank, layout=layout, engine_args=args,
                          init_method=layout.init_method, driver_addr=driver_addr, timeout_s=collective_timeout_s(),
                          num_threads=threads, log_level=log_level, spec_dir=spec_dir)
        path = os.path.join(spec_dir, f"rank{rank}.pkl")
        with open(path, "wb") as f:
            f.write(dumps(spec))
        procs[rank] = subprocess.Popen([sys.executable, "-m", "pagedllm.executor.worker_proc", path],
                                       env=envs.child_env(**RANK_DEFAULTS))
    return procs


class _Pending:
    """A launched step; result() waits for the output rank's ModelOutput (in launch order)."""

    def __init__(self, executor: "MultiprocExecutor", seq: int) -> None:
        self.executor, self.seq = executor, seq
        self._output: Optional[ModelOutput] = None

    def result(self) -> ModelOutput:
        if self._output is None:
            self._output = self.executor._wait_output(self.seq)
        return self._output


class _Done:
    def __init__(self, output: ModelOutput) -> None:
        self._output = output

    def result(self) -> ModelOutput:
        return self._output


class MultiprocExecutor:
    """Drives `world_size` worker ranks; `launch`/`execute_model` like the in-process Worker."""

    def __init__(self, args: Any, log_level: str = "INFO") -> None:
        import zmq

        self.model_dir, self.hf_config = prepare_model(args)
        head_ids = getattr(self.hf_config, "pagedllm_head_token_ids", None)
        if head_ids is not None:  # resolved once here: the ranks take the ids rather than load the tokenizer again
            args = copy.copy(args)
            args.hf_overrides = {**(args.hf_overrides or {}), "pagedllm_head_token_ids": list(head_ids)}
        self.args = args
        local_only = args.nnodes == 1 and not self.remote_workers
        self.layout = layout = self._make_layout(args, local_only)
        if self.remote_workers:  # the cluster places the ranks: no per-node device count to check here
            check_layout(layout, self.hf_config, "cpu", 0)
        else:
            check_devices(args, layout, self.hf_config)
        self.world_size = layout.world_size
        self.pipelined = layout.pipeline_parallel_size > 1
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._tmpdir = socket_directory("pagedllm-workers-")
        if local_only:
            addr = f"ipc://{self._tmpdir}/driver.sock"
            self._sock.bind(addr)
        else:
            try:
                self._sock.bind(f"tcp://*:{layout.driver_port}")
            except zmq.ZMQError as e:
                self._sock.close()
                self._ctx.term()
                shutil.rmtree(self._tmpdir, ignore_errors=True)
                raise RuntimeError(f"The head's plan socket cannot listen on port {layout.driver_port} "
                                   f"(--master-port {layout.master_port} + 1): {e}. Choose a --master-port whose next "
                                   f"port is free too.") from None
            addr = f"tcp://{layout.master_addr}:{layout.driver_port}"
        self._identities = [f"rank{r}".encode() for r in range(self.world_size)]
        self.procs: dict[int, subprocess.Popen] = {}
        self._seq = 0
        self._outputs: dict[int, ModelOutput] = {}
        self._tokens: list[tuple[str, int]] = []  # sampled since the last plan, for the earlier stages
        # seq of each launched step -> requests dropped (finished, aborted, preempted) by later plans: their
        # tokens of that step are void (a preempted request may be running again from scratch).
        self._in_flight: dict[int, set[str]] = {}
        # Steps below this seq were abandoned by the engine core (it recovered from a RequestStepError): their
        # outputs are dropped when they arrive.
        self._void_below = 0
        self._failed: Optional[str] = None
        self._closed = False
        try:
            self.procs = self._start_workers(args, layout, addr, log_level)
            facts = self._wait_ready(local_only)
        except BaseException:
            self.shutdown()
            raise
        for name, value in facts.items():
            setattr(self, name, value)
        # Every rank holds its shard of each adapter: registrations go to all of them (see RemoteLoRAs).
        self.lora_manager = RemoteLoRAs(self) if getattr(args, "enable_lora", False) else None
        logger.info("%d worker ranks ready (tensor_parallel_size=%d, pipeline_parallel_size=%d, %d node(s)).",
                    self.world_size, layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.nnodes)

    # ------------------------------------------------------------------ start-up
    remote_workers = False  # the Ray executor places ranks on other machines: TCP, not IPC
    # Speculative decoding is refused with worker processes (EngineArgs._validate_parallel_combinations).
    speculative = None
    num_speculative_tokens = 0
    spec_disable_batch_size = None

    def _make_layout(self, args: Any, local_only: bool) -> ParallelLayout:
        return layout_from_args(args, master_port=_free_port() if local_only else None)

    def _start_workers(self, args: Any, layout: ParallelLayout, addr: str, log_level: str) -> dict:
        """rank -> a handle with poll() / kill() / wait() / pid (subprocess.Popen here)."""
        return spawn_local_workers(args, layout, addr, self._tmpdir, log_level)

    def _wait_ready(self, local_only: bool) -> dict:
        ready: dict[int, dict] = {}
        deadline = time.monotonic() + join_timeout_s()
        while len(ready) < self.world_size:
            msg = self._recv(timeout_ms=_POLL_MS)
            if msg is None:
                self._check_procs(starting=True)
                if time.monotonic() > deadline:
                    raise RuntimeError(self._not_joined(set(ready)))
                continue
            if msg[0] == "ready":
                ready[msg[1]] = msg[2]
            elif msg[0] == "error":
                raise _startup_error(msg)
        return ready[self.layout.output_rank]

    def _not_joined(self, ready: set[int]) -> str:
        layout = self.layout
        missing = sorted(set(range(self.world_size)) - ready - set(self.procs))
        if not missing:  # only local ranks are late: they are still loading
            return f"worker ranks {sorted(set(self.procs) - ready)} were not ready within {join_timeout_s():.0f} s."
        nodes = sorted({r // layout.ranks_per_node for r in missing})
        return (f"node(s) {nodes} never joined within {join_timeout_s():.0f} s: start `pagedllm serve` with the "
                f"same model and -tp/-pp, --nnodes {layout.nnodes} --node-rank N --master-addr "
                f"{layout.master_addr} --master-port {layout.master_port} there (and check that port "
                f"{layout.master_port} and {layout.driver_port} of this machine are reachable).")

    # ------------------------------------------------------------------ steps
    def launch(self, plan: BatchPlan) -> Any:
        self._check_alive()
        tokens, self._tokens = self._tokens, []
        if plan.finished_request_ids:
            for dropped in self._in_flight.values():
                dropped.update(plan.finished_request_ids)
        seq = None
        if plan.total_num_scheduled_tokens:
            seq = self._seq
            self._seq += 1
            self._in_flight[seq] = set()
        payload = dumps(("plan", seq, plan, tokens))
        for ident in self._identities:
            self._sock.send_multipart([ident, payload], copy=False)
        return _Done(ModelOutput()) if seq is None else _Pending(self, seq)

    def control(self, *msg: Any, all_ranks: bool = False) -> Any:
        """Run one request on every rank, in order with the plans sent before it, and return the output rank's
        answer. A rank's ValueError (a user error, e.g. an adapter that cannot be served) is raised here as
        ValueError; the steps in flight keep going."""
        self._check_alive()
        payload = dumps(("control",) + msg)
        for ident in self._identities:
            self._sock.send_multipart([ident, payload], copy=False)
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + collective_timeout_s() + 30
        while len(replies) < self.world_size:
            self._check_alive()
            got = self._recv(timeout_ms=_POLL_MS)
            if got is None:
                self._check_procs()
                if time.monotonic() > deadline:
                    self._fail(f"no worker answered '{msg[0]}' within {collective_timeout_s() + 30:.0f} s")
                continue
            if got[0] in ("output", "step_error"):
                self._keep_output(got)
            elif got[0] == "control":
                replies[got[1]] = got[2:]
            elif got[0] == "error":
                self._fail_from_error(got)
        for rank in sorted(replies):
            ok, value = replies[rank]
            if not ok:
                raise ValueError(value)
        if all_ranks:
            return [replies[rank][1] for rank in sorted(replies)]
        return replies[self.layout.output_rank][1]

    def execute_model(self, plan: BatchPlan) -> ModelOutput:
        return self.launch(plan).result()

    @staticmethod
    def empty_output() -> ModelOutput:
        return ModelOutput()

    def _wait_output(self, seq: int) -> ModelOutput:
        deadline = time.monotonic() + collective_timeout_s() + 30
        while seq not in self._outputs:
            self._check_alive()
            msg = self._recv(timeout_ms=_POLL_MS)
            if msg is None:
                self._check_procs()
                if time.monotonic() > deadline:
                    self._fail(f"no worker answered step {seq} within {collective_timeout_s() + 30:.0f} s "
                               "(a rank hangs or a node is gone)")
                continue
            if msg[0] in ("output", "step_error"):
                self._keep_output(msg)
            elif msg[0] == "error":
                self._fail_from_error(msg)
        out = self._outputs.pop(seq)
        dropped = self._in_flight.pop(seq)
        if isinstance(out, RequestStepError):
            # The core recovers by abandoning every step in flight (their requests are recomputed): so does this.
            self._void_below = self._seq
            self._outputs.clear()
            self._in_flight.clear()
            raise out
        if dropped:
            out.sampled_token_ids = [[] if r in dropped else t for r, t in zip(out.req_ids, out.sampled_token_ids)]
        if self.pipelined:
            self._tokens += [(r, t[-1]) for r, t in zip(out.req_ids, out.sampled_token_ids) if t]
        return out

    def _keep_output(self, msg: tuple) -> None:
        """Hold a step's output (or its RequestStepError, which every rank skipped) until the core waits for it."""
        seq = msg[1]
        if seq < self._void_below:
            return
        self._outputs[seq] = msg[2] if msg[0] == "output" else RequestStepError(msg[2], msg[3], status=msg[4])

    # ------------------------------------------------------------------ health
    def _recv(self, timeout_ms: int) -> Optional[tuple]:
        if not self._sock.poll(timeout_ms):
            return None
        _, payload = self._sock.recv_multipart()
        return pickle.loads(payload)

    def _check_procs(self, starting: bool = False) -> None:
        dead = {rank: (proc, code) for rank, proc in self.procs.items() if (code := proc.poll()) is not None}
        if not dead:
            return
        # A dead rank's own error message (if it sent one) says more. Errors of the other ranks are usually
        # their broken connection to it, so they never stand in for it.
        errors: dict[int, tuple] = {}  # rank -> its first error message
        wait_ms = 200
        while (msg := self._recv(timeout_ms=wait_ms)) is not None:
            wait_ms = 20
            if msg[0] == "error":
                errors.setdefault(msg[1], msg)
        for rank in sorted(dead):
            if rank in errors:
                if starting:
                    raise _startup_error(errors[rank])
                self._fail(f"worker rank {rank} failed: {errors[rank][2]}")
        if starting and errors:  # start-up errors are causes (a bad setting, too little memory), not echoes
            raise _startup_error(errors[min(errors)])
        rank = min(dead)
        proc, code = dead[rank]
        text = f"worker rank {rank} (pid {proc.pid}) died with exit code {code}"
        if starting:
            raise RuntimeError(text + " during start-up.")
        self._fail(text)

    def _fail_from_error(self, msg: tuple) -> None:
        """A rank reported a failure; often it is the victim (a collective with a dead or hung peer failed), so
        name the dead local ranks first, and the ranks that went silent."""
        time.sleep(0.5)  # let the other ranks' reports and exits arrive
        self._check_procs()  # a dead local rank is the cause: fails with its name
        reported = {msg[1]: msg[2]}
        while (more := self._recv(timeout_ms=0)) is not None:
            if more[0] == "error":
                reported[more[1]] = more[2]
        silent = sorted(set(range(self.world_size)) - set(reported))
        text = "; ".join(f"worker rank {r} failed: {t}" for r, t in sorted(reported.items()))
        if silent:
            text += f"; rank(s) {silent} did not answer (dead or hung)"
        self._fail(text)

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise WorkerFailed(self._failed)

    def _fail(self, reason: str) -> None:
        self._failed = reason
        logger.error("Stopping the engine: %s.", reason)
        self._kill_workers()
        raise WorkerFailed(reason)

    def check_health(self) -> None:
        self._check_alive()
        self._check_procs()

    # ------------------------------------------------------------------ shutdown
    def _kill_workers(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._failed is None and self.procs:
            try:
                payload = dumps(("shutdown",))
                for ident in self._identities:
                    self._sock.send_multipart([ident, payload])
            except Exception:  # noqa: BLE001
                pass
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
                time.sleep(0.02)
        self._kill_workers()
        self._sock.close(0)
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass

    # Sleep mode: every rank frees / restores its own shard (the engine core checked the request first).
    def sleep(self, level: int = 1) -> None:
        self.control("sleep", level)

    def wake_up(self, tags=("weights", "kv_cache")) -> None:
        self.control("wake_up", list(tags))

    def reload_weights(self) -> None:
        self.control("reload_weights")

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """One worker method on every rank; the answers in rank order (vLLM's collective_rpc)."""
        try:  # (ranks get the call pickled: a module-level function goes, a lambda or closure cannot)
            pickle.dumps((method, tuple(args), dict(kwargs or {})))
        except Exception as e:  # noqa: BLE001 - pickle raises several kinds for what it cannot send
            raise ValueError(f"collective_rpc: {method!r} or its arguments cannot be sent to the worker processes "
                             f"({e}); pass module-level functions.") from None
        return self.control("rpc", method, tuple(args), dict(kwargs or {}), all_ranks=True)


class RemoteLoRAs:
    """The engine core's view of the ranks' LoRA managers (the in-process Worker's `lora_manager` interface)."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self.executor = executor

    def add_lora(self, lora_int_id: int, name: str, path: str) -> None:
        self.executor.control("lora_add", lora_int_id, name, path)

    def remove_lora(self, lora_int_id: int) -> bool:
        return bool(self.executor.control("lora_remove", lora_int_id))

    def list_loras(self) -> list[int]:
        return list(self.executor.control("lora_list"))


def _startup_error(msg: tuple) -> Exception:
    _, rank, text, user_error = msg
    if user_error:  # a ValueError's sentence (not enough memory, a bad layout): the user's to fix
        return ValueError(text)
    return RuntimeError(f"worker rank {rank} failed during start-up: {text}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
