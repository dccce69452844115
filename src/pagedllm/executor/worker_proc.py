"""A worker process: one rank of the tensor x pipeline world.

Joins torch.distributed (rendezvous at the master address), builds its Worker (model shard, KV cache agreed
with every rank), says ready to the engine core's executor, then runs the plans it is sent, in order:

    ("plan", seq, plan, tokens)  -> launch the step; the output rank sends ("output", seq, ModelOutput), or
                                    ("step_error", seq, request ids, message, status) for a RequestStepError
    ("control", op, *args)       -> e.g. register a LoRA adapter; every rank answers ("control", rank, ok, value)
    ("shutdown",)                -> exit 0

Any failure (a collective that timed out because a peer died or hangs, an exception) is sent to the executor
as ("error", rank, one line) before the process exits non-zero, so the engine stops with the rank's name.

With async scheduling, steps overlap like the in-process path: while step N runs on the device, the next plan
is launched as soon as it arrives, and N's output is sent when it is ready. Without it, N's tokens are in the
rank's state before the next plan runs (that plan was made after them).
"""
from __future__ import annotations

import logging
import pickle
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.process_utils import one_line, watch_parent as _watch_parent

logger = logging.getLogger("pagedllm.worker")


# What a rank's environment gets unless it sets it (through envs.child_env / child_vars): N ranks would draw N
# copies of every progress bar.
RANK_DEFAULTS = {"PAGEDLLM_DISABLE_PROGRESS_BARS": "1"}


@dataclass
class WorkerSpec:
    rank: int
    local_rank: int
    layout: Any  # ParallelLayout
    engine_args: Any
    init_method: str
    driver_addr: str
    timeout_s: float
    num_threads: int
    log_level: str = "INFO"
    # The directory the parent made for the ranks' spec files (and, on one node, its plan socket): a parent killed
    # could not remove it, so the rank that outlives it does
    spec_dir: Optional[str] = None


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def main() -> None:
    """`python -m pagedllm.executor.worker_proc SPEC_FILE`: the spec is a pickled WorkerSpec."""
    with open(sys.argv[1], "rb") as f:
        spec: WorkerSpec = pickle.load(f)
    sys.exit(run_worker(spec))


def run_worker(spec: WorkerSpec, watch_parent: bool = True) -> int:
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(levelname)s %(asctime)s [rank {spec.rank}] %(message)s", datefmt="%H:%M:%S")
    if watch_parent:
        _watch_parent(exit_code=1, leftovers=spec.spec_dir)
    import zmq

    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{spec.rank}".encode())
    sock.setsockopt(zmq.LINGER, 2000)
    monitor = None
    if spec.driver_addr.startswith("tcp://"):
        # Another machine's engine: notice it going away (a dead process closes the connection; a dead
        # machine stops answering heartbeats) instead of waiting for plans forever.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15000)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(spec.driver_addr)
    try:
        worker = _build(spec)
        sock.send(dumps(("ready", spec.rank, _facts(worker))))
        _loop(spec, worker, sock, zmq, monitor)
        return 0
    except BaseException as e:  # noqa: BLE001 - whatever it is, the executor must hear it with the rank
        logger.debug("worker failed", exc_info=True)
        try:
            sock.send(dumps(("error", spec.rank, one_line(e), isinstance(e, ValueError))))
        except Exception:  # noqa: BLE001
            pass
        return 1
    finally:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(0)
        sock.close()
        ctx.term()


def _build(spec: WorkerSpec) -> Any:
    import torch

    from pagedllm.distributed import parallel_state as ps
    from pagedllm.worker.worker import Worker

    torch.set_num_threads(spec.num_threads)
    layout = spec.layout
    backend = "nccl" if spec.engine_args.device != "cpu" and torch.cuda.is_available() else "gloo"
    ps.init_distributed_environment(layout.world_size, spec.rank, spec.init_method, spec.local_rank, backend,
                                    timeout_s=spec.timeout_s)
    ps.initialize_model_parallel(layout.tensor_parallel_size, layout.pipeline_parallel_size)
    return Worker(spec.engine_args, local_rank=spec.local_rank)


def _facts(worker: Any) -> dict:
    return {name: getattr(worker, name) for name in (
        "model_dir", "hf_config", "max_model_len", "vocab_size", "eos_token_ids", "num_blocks", "max_num_seqs",
        "max_num_batched_tokens", "async_scheduling", "kv_group_windows", "long_rope_original",
        "ntk_original")}


def _recv(sock: Any, zmq: Any, monitor: Any) -> Any:
    if monitor is None:
        return pickle.loads(sock.recv())
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if sock in ready:
            return pickle.loads(sock.recv())
        if monitor in ready:
            monitor.recv_multipart()
            raise RuntimeError("lost the connection to the head node's engine")


def _loop(spec: WorkerSpec, worker: Any, sock: Any, zmq: Any, monitor: Any = None) -> None:
    from pagedllm.core.errors import RequestStepError

    is_output_rank = spec.rank == spec.layout.output_rank
    # The last stage's ranks sampled those tokens themselves; the earlier stages learn them with the next plan.
    is_last_stage = spec.rank >= spec.layout.output_rank
    pending = None  # (seq, PendingOutput) of the launched step whose output is not sent yet

    def finish() -> None:
        nonlocal pending
        seq, out = pending
        pending = None
        result = out.result()
        if is_output_rank:
            sock.send(dumps(("output", seq, result)))

    while True:
        if pending is not None:
            # Launch the next plan the moment it arrives; send this step's output the moment it is ready.
            while not sock.poll(0):
                if _done(pending[1]):
                    finish()
                    break
                time.sleep(0)
        msg = _recv(sock, zmq, monitor)
        if msg[0] == "shutdown":
            if pending is not None:
                finish()
            return
        if msg[0] == "control":
            sock.send(dumps(("control", spec.rank) + _control(worker, msg[1:])))
            continue
        _, seq, plan, tokens = msg
        if tokens and not is_last_stage:
            worker.apply_sampled_tokens(tokens)
        if pending is not None and (not worker.async_scheduling or _done(pending[1])):
            # Without async scheduling a plan assumes every earlier step's tokens are in the state. With it, a
            # finished step's output goes first: the engine core applies it while this rank prepares the plan.
            finish()
        try:
            launched = worker.launch(plan)
        except RequestStepError as e:
            # Some requests' fault, found on every rank alike before the step's first collective (e.g. an adapter
            # that cannot be read again: LoRAManager agrees on it across ranks): the step is skipped everywhere
            # and the engine core fails those requests alone.
            if pending is not None:
                finish()
            if is_output_rank and seq is not None:
                sock.send(dumps(("step_error", seq, e.request_ids, e.message, e.status)))
            continue
        if pending is not None:
            finish()
        if seq is not None:
            pending = (seq, launched)


def _control(worker: Any, msg: tuple) -> tuple[bool, Any]:
    """(ok, value) of one control request; a ValueError (the user's to fix) comes back as (False, sentence)."""
    op, args = msg[0], msg[1:]
    try:
        manager = worker.lora_manager
        if manager is None and op.startswith("lora_"):
            raise ValueError("LoRA adapters need the engine started with enable_lora=True (--enable-lora).")
        if op == "lora_add":
            manager.add_lora(*args)
            return True, None
        if op == "lora_remove":
            return True, manager.remove_lora(*args)
        if op == "lora_list":
            return True, manager.list_loras()
        if op in ("sleep", "wake_up", "reload_weights"):  # sleep mode: each rank its own shard
            return True, getattr(worker, op)(*args)
        if op == "rpc":
            method, call_args, call_kwargs = args
            from pagedllm.executor.uniproc import rpc_method

            return True, rpc_method(worker, method)(*call_args, **call_kwargs)
        raise ValueError(f"unknown control request {op!r}")
    except ValueError as e:
        return False, str(e)


def _done(out: Any) -> bool:
    event = getattr(out, "event", None)
    return event is None or event.query()


if __name__ == "__main__":
    main()
