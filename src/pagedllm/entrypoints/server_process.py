"""Helpers for programs that run `pagedllm serve` as a child process (the serving benchmarks, the end-to-end
tests): a free local port, and waiting until the server answers /health."""
from __future__ import annotations

import socket
import subprocess
import time
from typing import Optional


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 300, log_path: Optional[str] = None) -> None:
    """Poll url + "/health" until it answers 200. Raises RuntimeError when the process exits first (with the
    tail of its log, if given) or when timeout_s passes (the process is then killed)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = ""
            if log_path is not None:
                with open(log_path, errors="replace") as f:
                    tail = ":\n" + f.read()[-4000:]
            raise RuntimeError(f"the server exited with code {proc.returncode}{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not answer {url}/health within {timeout_s:.0f} s")
