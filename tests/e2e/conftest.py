"""End-to-end fixtures: one real `pagedllm serve` (SmolLM2-135M on the CPU) on a free port for the session.

The server is started the way a user would start it (`pagedllm serve MODEL --config FILE.yaml --port P`),
with settings in a YAML file so `--config` is exercised by every test, and an API key so auth is too.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

API_KEY = "e2e-secret"
SERVED_NAME = "smol"
MAX_MODEL_LEN = 1024
BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(name: str) -> str:
    return os.path.join(BIN, name)


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    port: int
    model_dir: str
    proc: subprocess.Popen
    log_path: str

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120, **kw)


def wait_healthy(proc: subprocess.Popen, url: str, log_path: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{f.read()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy in time")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="session")
def e2e_env(smollm2_cache_dir: str) -> dict:
    env = dict(os.environ)
    env["PAGEDLLM_CACHE_DIR"] = smollm2_cache_dir  # the default model converts once, into the test cache
    env["PAGEDLLM_DISABLE_PROGRESS_BARS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="session")
def server(smollm2_hf_dir: str, e2e_env: dict, tmp_path_factory: pytest.TempPathFactory) -> Server:
    tmp = tmp_path_factory.mktemp("server")
    config = tmp / "serve.yaml"
    # port 1 in the file: the command line's --port must win
    config.write_text(f"api-key: {API_KEY}\nserved-model-name: [{SERVED_NAME}, smol-alias]\n"
                      f"max-model-len: {MAX_MODEL_LEN}\nkv-cache-memory-bytes: {256 << 20}\nport: 1\nseed: 0\nmax-num-seqs: 64\n")
    port = free_port()
    log_path = str(tmp / "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([cli("pagedllm"), "serve", smollm2_hf_dir, "--config", str(config), "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=e2e_env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path)
        yield Server(url, port, smollm2_hf_dir, proc, log_path)
    finally:
        stop(proc)


@pytest.fixture()
def http(server: Server) -> httpx.Client:
    with server.client() as c:
        yield c


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
