"""Helpers of the deployment / robustness tests: start `pagedllm serve` (or any command) on a free loopback
port, read SSE streams, read Prometheus samples. Fixtures are in conftest.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Iterable, Optional

import httpx

from pagedllm.entrypoints.server_process import free_port, wait_healthy

BIN = os.path.dirname(sys.executable)
# Settings of the shared `tiny_server` fixture (conftest.py); here because a bare `import conftest` can resolve
# to another directory's conftest in a mixed run.
API_KEY = "robust-secret-key"
SEND_TIMEOUT = 3
MAX_BODY = 1 << 20
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Proc:
    url: str
    port: int
    proc: subprocess.Popen
    log_path: str
    extra: dict = field(default_factory=dict)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def launch(model_dir: str, flags: Iterable[str], env: dict, log_path: str, command: Optional[list[str]] = None,
           port: Optional[int] = None, timeout_s: float = 180) -> Proc:
    """`pagedllm serve MODEL --port P FLAGS` (or `command + [MODEL, FLAGS]` with PAGEDLLM_PORT=P set), waited
    until /health is 200."""
    port = port or free_port()
    env = dict(env)
    forced = os.environ.get("PAGEDLLM_TEST_API_SERVERS")  # run the suite against N API server processes
    flags = list(flags)
    if forced and "--api-server-count" not in flags:
        flags += ["--api-server-count", forced]
    if command is None:
        argv = [os.path.join(BIN, "pagedllm"), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), *flags]
    else:
        env.update(PAGEDLLM_HOST="127.0.0.1", PAGEDLLM_PORT=str(port))
        argv = [*command, model_dir, *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout_s=timeout_s, log_path=log_path)
    return Proc(url, port, proc, log_path)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait_s: float = 30) -> Optional[int]:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def sse_events(lines: Iterable[str]) -> list:
    """The `data:` payloads of an SSE stream: parsed JSON, or the string "[DONE]"."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text format)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        rest = head[len(name):]
        if rest and not rest.startswith("{"):
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


def completion_body(max_tokens: int, stream: bool, **extra) -> dict:
    body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def client(url: str, **kw) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=kw.pop("timeout", 60), **kw)
