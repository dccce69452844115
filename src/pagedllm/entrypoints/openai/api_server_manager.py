"""Several API server processes over the same engine cores: `pagedllm serve --api-server-count N` (vLLM's flag).

One API process turns HTTP into engine requests and engine outputs into HTTP (tokenizing, detokenizing, JSON,
SSE) on one CPU core; past a load, that core is what holds the engine back. With N > 1 the process that runs
`pagedllm serve` becomes a supervisor that serves no HTTP itself:

  supervisor ── spawns ──► engine core(s) (as with one API process)
             └─ spawns ──► N API server processes, each binding the same host:port with SO_REUSEPORT (the kernel
                           spreads connections over their listening sockets) and owning the clients it accepts;
                           each has its own ZMQ channels to every engine core (entrypoints/ipc.py), and the engine
                           core sends each request's outputs back to the process that sent it.

The supervisor holds the port from the start (bound, not listening: a busy port fails at once and nobody takes
it while the model loads), starts the engine cores and the API processes together (the API processes import
their libraries and load the tokenizer while the model loads), and reports one line when all of them serve, or
the first start-up error once. Then it watches:
  * SIGTERM / SIGINT -> SIGTERM to every API process: each drains (lifecycle.py); when all have exited the
    engine cores are told to shut down; a second signal -> SIGTERM again (each stops at once);
  * an API process that dies -> logged with its exit status, the engine cores abort its requests and stop
    sending to it (ClientGone), the others drain and the server exits 1: it never goes on with part of its
    processes (clients hashed to the dead one would be refused);
  * an engine core that dies -> logged, each API process is told (EngineDead on its output channel: /health 503,
    requests fail with 503) and exits 1 after --engine-dead-grace-period, as with one API process.
Metrics: every API process records into prometheus_client's multiprocess directory, summed at scrape
(pagedllm/metrics/).
"""
from __future__ import annotations

import argparse
import copy
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import time
from multiprocessing.connection import wait
from typing import Any, Callable, Optional

logger = logging.getLogger("pagedllm.api_server")

MAX_DEFAULT_API_SERVERS = 4  # the default never goes past it (each process is one more fan-out per engine step)
_POLL_S = 0.2


def available_cpus() -> int:
    """CPU cores this process may use: its affinity mask, capped by a cgroup CPU quota (containers)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, int(quota + 0.999)))
    return max(1, cpus)


def _cgroup_cpu_quota() -> Optional[float]:
    """CPUs allowed by the cgroup's CFS quota (v2 cpu.max, else v1), None without a quota."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def _serves_on_gpu(engine_args: Any) -> bool:
    """Whether the engine will run on a GPU, without importing torch here (seconds, and memory this process would
    keep): device auto counts the NVIDIA GPUs the driver lists (a guess for a default only: a wrong one costs an
    idle process or some throughput, never a request)."""
    device = getattr(engine_args, "device", "auto")
    if device in ("cpu", "cuda"):
        return device == "cuda"
    from pagedllm import envs

    if (envs.CUDA_VISIBLE_DEVICES or "").strip() == "-1":
        return False
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


def default_api_server_count(engine_args: Any, cpus: Optional[int] = None) -> int:
    """1 on a small machine or when the model runs on the CPU (the model's threads want every core; another API
    process would take from them); on a GPU, one API process per two cores left after the engine's own busy
    processes (engine cores, worker ranks), at most MAX_DEFAULT_API_SERVERS."""
    cpus = available_cpus() if cpus is None else cpus
    if cpus < 4 or not hasattr(socket, "SO_REUSEPORT") or not _serves_on_gpu(engine_args):
        return 1
    engines = max(1, int(getattr(engine_args, "data_parallel_size", 1) or 1))
    ranks = int(getattr(engine_args, "tensor_parallel_size", 1) or 1) * int(
        getattr(engine_args, "pipeline_parallel_size", 1) or 1)
    busy = engines * (1 if ranks == 1 else 1 + ranks)
    return max(1, min(MAX_DEFAULT_API_SERVERS, (cpus - busy) // 2))


def resolve_api_server_count(args: argparse.Namespace, engine_args: Any) -> int:
    """--api-server-count, or the default for this machine. ValueError for a count that cannot be served."""
    count = getattr(args, "api_server_count", None)
    if count is None:
        return default_api_server_count(engine_args)
    if count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {count}.")
    if count > 1 and not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError("--api-server-count > 1 needs SO_REUSEPORT (Linux, macOS, BSD); use 1 here.")
    return count


def reserve_port(host: str, port: int, bind: Callable[..., socket.socket]) -> socket.socket:
    """Hold host:port for the API processes: fail now if anyone has it (a plain bind, which no SO_REUSEPORT
    socket of another program can share), then keep it bound with SO_REUSEPORT, never listening (the kernel
    gives connections only to listening sockets)."""
    bind(host, port).close()
    return bind(host, port, reuse_port=True)


def _describe_exit(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class APIServerSupervisor:
    """Starts and watches the engine cores and the API server processes (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, engine_args: Any, count: int, child_target: Callable,
                 bind: Callable[..., socket.socket]) -> None:
        self.args = args
        self.engine_args = engine_args
        self.count = count
        self.child_target = child_target  # api_server.run_api_child(args, client, report)
        self.bind = bind
        self.log_level = args.log_level if args.log_level != "trace" else "debug"
        self.num_engines = max(1, int(getattr(engine_args, "data_parallel_size", 1) or 1))
        self.engines: list = []
        self.apis: list = []
        self.reports: list = []
        self.signals = 0
        self.last_signal = signal.SIGINT
        self.serving = False
        self.stopping = False
        self.engine_dead = False
        self.exit_code = 0

    # ---- signals --------------------------------------------------------------------------------

    def _on_signal(self, sig: int, frame: Any) -> None:
        self.signals += 1
        self.last_signal = sig
        if not self.serving:
            return  # the start-up loop stops everything
        if self.signals == 1:
            logger.info("%s: draining %d API server process(es)", signal.Signals(sig).name, self.count)
        self.stopping = True
        self._signal_apis()

    def _signal_apis(self) -> None:
        for proc in self.apis:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    # ---- the run --------------------------------------------------------------------------------

    def run(self) -> int:
        import zmq

        from pagedllm import envs
        from pagedllm.entrypoints import messages as m
        from pagedllm.entrypoints.async_engine import start_engine_cores
        from pagedllm.entrypoints.ipc import DIR_PREFIX, ClientSpec, IPCLayout
        from pagedllm.process_utils import socket_directory

        placeholder = reserve_port(self.args.host, self.args.port, self.bind)
        args = copy.copy(self.args)
        args.port = placeholder.getsockname()[1]  # --port 0: the port the kernel chose, for every process
        directory = socket_directory(DIR_PREFIX)
        layout = IPCLayout(directory, num_clients=self.count, num_engines=self.num_engines)
        os.makedirs(layout.metrics_dir)
        ctx = zmq.Context(io_threads=1)
        self.enc = m.Encoder()
        self.m = m
        self.controls = []
        for e in range(self.num_engines):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.bind(layout.control(e))
            self.controls.append(sock)
        self.notifiers = []
        for c in range(self.count):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(layout.output(c))
            self.notifiers.append(sock)
        old_handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.engines = start_engine_cores(self.engine_args, self.log_level,
                                              [layout.engine_inputs(e) for e in range(self.num_engines)],
                                              layout.engine_outputs())
            spawn = multiprocessing.get_context("spawn")
            # prometheus_client takes its multiprocess directory from the environment at import: each API process
            # gets it at start (and pagedllm's own runtime variables, as the engine cores do).
            with envs.environ_set({**envs.child_vars(), "PROMETHEUS_MULTIPROC_DIR": layout.metrics_dir}):
                for c in range(self.count):
                    ours, theirs = spawn.Pipe()
                    proc = spawn.Process(target=self.child_target, args=(args, ClientSpec(c, layout), theirs),
                                         name=f"pagedllm-api-server-{c}", daemon=True)
                    proc.start()
                    theirs.close()
                    self.apis.append(proc)
                    self.reports.append(ours)
            code = self._wait_started(args)
            if code is not None:
                return code
            self.serving = True
            if self.signals:  # stopped while the first processes served already: they drain
                self.stopping = True
                self._signal_apis()
            return self._supervise()
        finally:
            self._stop_all()
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            for sock in self.controls + self.notifiers:
                sock.close()
            ctx.term()
            placeholder.close()
            shutil.rmtree(directory, ignore_errors=True)

    def _wait_started(self, args: argparse.Namespace) -> Optional[int]:
        """Until every API process serves (None), or the exit code of a failed start (the error printed once).
        Each reports "prepared" (engine cores ready, tokenizer and app built), waits for "go", listens, reports
        "ready": all of them start listening together, so the first clients (a benchmark's connections, kept for
        its whole run) are spread over all of them, not given to whichever was first."""
        ready: dict[int, dict] = {}
        prepared: set[int] = set()
        dead_engines: set[int] = set()
        while len(ready) < self.count:
            if self.signals and ready:  # some processes serve clients already: they drain, the others stop
                logger.info("%s during start-up: draining the %d API server process(es) serving already",
                            signal.Signals(self.last_signal).name, len(ready))
                return None
            if self.signals:  # stopped before serving: the shell's code for death by that signal
                return 128 + int(self.last_signal)
            conns = [r for i, r in enumerate(self.reports) if i not in ready]
            sentinels = {p.sentinel: ("api", i) for i, p in enumerate(self.apis) if i not in ready}
            sentinels.update({p.sentinel: ("engine", i) for i, p in enumerate(self.engines) if i not in dead_engines})
            for obj in wait(conns + list(sentinels), timeout=_POLL_S):
                if obj in sentinels:
                    kind, i = sentinels[obj]
                    (self.engines if kind == "engine" else self.apis)[i].join(5)
                    if kind == "engine":
                        # Its one-line reason reaches the API processes first (sent before it exited); they report
                        # it. Without one (killed), they learn of the exit from here.
                        dead_engines.add(i)
                        code = _describe_exit(self.engines[i].exitcode)
                        self._notify_engine_dead(i, f"its process exited with {code} during startup")
                        continue
                    report = self._read_report(self.reports[i])
                    if report is None:
                        print(f"error: API server {i} exited with {_describe_exit(self.apis[i].exitcode)} during "
                              "startup", file=sys.stderr)
                        return 1
                    obj = self.reports[i]
                else:
                    report = self._read_report(obj)
                    i = self.reports.index(obj)
                if report is None:
                    continue
                if report[0] == "error":
                    _, code, message = report
                    print(f"error: {message}", file=sys.stderr)
                    return code
                if report[0] == "prepared":
                    prepared.add(i)
                    if len(prepared) == self.count:
                        for conn in self.reports:
                            conn.send(("go",))
                    continue
                ready[i] = report[1]
        info = ready[0]
        from pagedllm.entrypoints.openai.cli_args import server_url

        logger.info("Serving %s (from %s, max_model_len %d) at %s/v1 with %d API server processes "
                    "(pids %s) over %d engine core(s) (pids %s)", info["name"], info["model_dir"],
                    info["max_model_len"], server_url(args), self.count, ", ".join(str(p.pid) for p in self.apis),
                    self.num_engines, ", ".join(str(p.pid) for p in self.engines))
        if getattr(args, "dashboard", False):
            logger.info("Dashboard: %s/dashboard", server_url(args))
        return None

    @staticmethod
    def _read_report(conn: Any) -> Optional[tuple]:
        try:
            if conn.poll():
                return conn.recv()
        except (EOFError, OSError):
            pass
        return None

    def _supervise(self) -> int:
        """Until every API process has exited; the server's exit code."""
        watched = {p.sentinel: ("api", i) for i, p in enumerate(self.apis)}
        watched.update({p.sentinel: ("engine", i) for i, p in enumerate(self.engines)})
        while any(kind == "api" for kind, _ in watched.values()):
            for obj in wait(list(watched), timeout=_POLL_S):
                kind, i = watched.pop(obj)
                (self.engines if kind == "engine" else self.apis)[i].join(5)  # its exit code is known after
                if kind == "engine":
                    self._engine_exited(i)
                else:
                    self._api_exited(i)
        return self.exit_code

    def _api_exited(self, i: int) -> None:
        proc = self.apis[i]
        code = proc.exitcode
        if self.engine_dead:  # the grace period's exit (code 1), as with one API process
            self.exit_code = max(self.exit_code, code if code and code > 0 else 1)
            return
        if self.stopping:
            if code not in (0, -signal.SIGTERM):
                logger.error("API server %d (pid %d) ended its drain with %s", i, proc.pid, _describe_exit(code))
                self.exit_code = 1
            return
        logger.error("API server %d (pid %d) died (%s): stopping the server (the other API processes drain), "
                     "exit code 1", i, proc.pid, _describe_exit(code))
        self.exit_code = 1
        for sock in self.controls:
            self._send(sock, self.m.ClientGone(i))
        self.stopping = True
        self._signal_apis()

    def _engine_exited(self, i: int) -> None:
        if self.stopping and all(not p.is_alive() for p in self.apis):
            return
        code = self.engines[i].exitcode
        which = "the engine core" if self.num_engines == 1 else f"engine core {i}"
        logger.error("%s (pid %d) died (%s)", which, self.engines[i].pid, _describe_exit(code))
        self.engine_dead = True
        self.exit_code = 1
        self._notify_engine_dead(i, f"its process died ({_describe_exit(code)})")

    def _notify_engine_dead(self, engine: int, message: str) -> None:
        for sock in self.notifiers:
            self._send(sock, self.m.EngineDead(message=message, engine_index=engine))

    def _send(self, sock: Any, msg: Any) -> None:
        import zmq

        try:
            sock.send(self.enc.encode(msg), flags=zmq.DONTWAIT)
        except zmq.ZMQError:
            pass

    def _stop_all(self) -> None:
        """API processes first (they may still drain), then the engine cores (Shutdown, then signals)."""
        from pagedllm.process_utils import end_process

        deadline = time.monotonic() + 5
        for proc in self.apis:  # after a normal run they have all exited
            if proc.is_alive():
                proc.terminate()
        for proc in self.apis:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(3)
        for sock in self.controls:
            self._send(sock, self.m.Shutdown())
        deadline = time.monotonic() + 5
        for proc in self.engines:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.engines:
            end_process(proc)


def serve_with_api_servers(args: argparse.Namespace, engine_args: Any, count: int, child_target: Callable,
                           bind: Callable[..., socket.socket]) -> int:
    return APIServerSupervisor(args, engine_args, count, child_target, bind).run()
