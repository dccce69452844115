"""Constants and helpers shared by the e2e tests (the fixtures live in conftest.py)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import httpx

API_KEY = "e2e-secret"
SERVED_NAME = "smol"
MAX_MODEL_LEN = 1024
BIN = os.path.dirname(sys.executable)

# Modules whose servers also run with 2 API server processes (`--api-server-count 2`): every module of the shared
# server but the CLI's (one more server start, ~10 s, and their own tests' time), and the LoRA server. The modules
# that start servers of their own run with one; PAGEDLLM_TEST_API_SERVERS=N runs every server with N processes.
TWO_API_SERVER_MODULES = ("test_openai_sdk.py", "test_concurrency.py", "test_http.py", "test_request_fields.py",
                          "test_structured_tools.py", "test_beam_search_http.py", "test_echo_logprobs.py",
                          "test_lora_server.py")


def api_server_counts(module_file: str) -> list[int]:
    """The --api-server-count values a module's servers run with."""
    forced = os.environ.get("PAGEDLLM_TEST_API_SERVERS")
    if forced:
        return [int(forced)]
    return [1, 2] if os.path.basename(module_file) in TWO_API_SERVER_MODULES else [1]


def cli(name: str) -> str:
    return os.path.join(BIN, name)


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    port: int
    model_dir: str
    proc: subprocess.Popen
    log_path: str
    api_servers: int = 1  # --api-server-count

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120, **kw)


def wait_all_serving(server: "Server", timeout_s: float = 120) -> None:
    """With several API server processes /health answers once the first listens; the supervisor's "Serving" line
    says all of them do (tests that count per process wait for it)."""
    import time

    if server.api_servers < 2:
        return
    deadline = time.monotonic() + timeout_s  # a hang guard
    while f"with {server.api_servers} API server processes" not in server.log():
        assert server.proc.poll() is None and time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.05)


@contextlib.contextmanager
def serving(model_dir: str, flags: list[str], log_path: str, env: Optional[dict] = None) -> Iterator[str]:
    """`pagedllm serve MODEL --port P FLAGS` on a free port, until the block ends: its URL once /health answers."""
    from pagedllm.entrypoints.server_process import free_port, wait_healthy

    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([cli("pagedllm"), "serve", model_dir, "--port", str(port), *flags],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path=log_path)
        yield url
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0.0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        rest = head[len(name):]
        if rest and not rest.startswith("{"):
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return float(value)
    return 0.0


def dashboard_event(http: httpx.Client, predicate: Callable[[dict], bool], what: str,
                    hang_guard_s: float = 120) -> dict:
    """The first event of /dashboard/events (read as a page reads it) for which predicate holds. The stream sends an
    event ~4 times a second (a comment line when the engine is slow), so the hang guard is checked as it runs."""
    deadline = time.monotonic() + hang_guard_s
    with http.stream("GET", "/dashboard/events", timeout=hang_guard_s) as r:
        assert r.status_code == 200, r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                if predicate(event):
                    return event
            assert time.monotonic() < deadline, f"no dashboard event with {what} (hang guard)"
    raise AssertionError("the dashboard's event stream ended")
