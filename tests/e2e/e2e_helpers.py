"""Constants and helpers shared by the e2e tests (the fixtures live in conftest.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import httpx

API_KEY = "e2e-secret"
SERVED_NAME = "smol"
MAX_MODEL_LEN = 1024
BIN = os.path.dirname(sys.executable)


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
