"""`pagedllm serve` under a benchmark: start it on a free loopback port with its log in a file, wait for /health,
stop it; the `pagedllm bench serve` run against it; the CPU seconds its processes spent. Shared by the benchmarks
that start a server (dashboard_cost.py, gateway_vs_direct.py, serve_vs_offline.py, stream_smoothness.py,
cpu_gguf_serve.py). Not a benchmark: scripts here import it as `_server` (their folder is on sys.path).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from pagedllm.entrypoints.server_process import free_port, wait_healthy

PAGEDLLM = [sys.executable, "-m", "pagedllm.entrypoints.cli.main"]  # works without the console script too
QUIET = ["--disable-uvicorn-access-log", "--log-level", "warning"]  # a benchmark's log holds only what went wrong


@dataclass
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    port: int
    log_path: str
    stop_signal: int = signal.SIGTERM  # SIGTERM drains; SIGINT as Ctrl-C
    stop_wait_s: float = 60

    def stop(self) -> None:
        """Signal the server, wait up to stop_wait_s for it to exit, then kill it."""
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
        try:
            self.proc.wait(self.stop_wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def start_server(model: Optional[str], flags: Iterable[str], log_path: str, quiet: bool = True,
                 env: Optional[dict] = None, wait: bool = True, timeout_s: float = 600,
                 stop_signal: int = signal.SIGTERM, stop_wait_s: float = 60) -> Server:
    """`pagedllm serve [MODEL] --port P [QUIET] FLAGS` (no MODEL: the default model), its output in log_path;
    with `wait`, returned once /health answers 200 (stopped if it never does)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [*PAGEDLLM, "serve", *([model] if model else []), "--port", str(port), *(QUIET if quiet else []), *flags]
    with open(log_path, "w") as log:  # the child writes through its own descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, url, port, log_path, stop_signal, stop_wait_s)
    if wait:
        try:
            wait_healthy(proc, url, timeout_s=timeout_s, log_path=log_path)
        except BaseException:
            server.stop()
            raise
    return server


def bench_serve_cmd(url: str, num_prompts: int, concurrency: int, input_len: int, output_len: int, seed: int,
                    result: str, extra: Iterable[str] = ()) -> list[str]:
    """`pagedllm bench serve` of num_prompts random-token prompts (a distinct seed: no prefix-cache hits) of
    input_len tokens, output_len out (ignore_eos), at most `concurrency` in flight, its result saved as JSON."""
    return [*PAGEDLLM, "bench", "serve", "--base-url", url, "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), *extra, "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
            "--save-result", "--result-filename", result]


def bench(url: str, args: Any, seed: int, num_prompts: int, result: str) -> dict:
    """bench_serve_cmd at the benchmark's --concurrency / --input-len / --output-len (args), run quietly; its
    result."""
    subprocess.run(bench_serve_cmd(url, num_prompts, args.concurrency, args.input_len, args.output_len, seed, result),
                   check=True, stdout=subprocess.DEVNULL)
    with open(result) as f:
        return json.load(f)


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def server_cpu(pid: int) -> tuple[float, float]:
    """(the process, its children alive now: a server's engine core, nginx's workers) CPU seconds."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return process_cpu(pid), sum(process_cpu(int(x)) for x in out.split())


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children that are alive now."""
    return sum(server_cpu(pid))
