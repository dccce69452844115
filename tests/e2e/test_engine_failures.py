"""Engine-process failures against a real server (SmolLM2 on the CPU, a small KV pool): a prompt the pool
cannot hold is a 400, and a killed engine process gives /health 503 and errors (not hangs) for pending and
new requests."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx

from e2e_helpers import cli, metric, stop

from pagedllm.entrypoints.server_process import free_port, wait_healthy


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_dead_engine_fails_requests_and_health(e2e_env: dict, smollm2_hf_dir: str, tmp_path) -> None:
    env = dict(e2e_env)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = str(tmp_path / "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([cli("pagedllm"), "serve", smollm2_hf_dir, "--port", str(port),
                                 "--num-gpu-blocks-override", "128", "--max-model-len", "2048",
                                 "--engine-dead-grace-period", "60"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, url, timeout_s=120, log_path=log_path)
        ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        # the engine refuses what cannot fit its context (2048 tokens, its whole KV pool): a 400, streaming or not
        for stream in (False, True):
            big = httpx.post(url + "/v1/completions", json={"prompt": [1000] * 3000, "max_tokens": 2,
                                                            "stream": stream}, timeout=30)
            assert big.status_code == 400 and "maximum context length is 2048" in big.json()["error"]["message"], \
                big.text
        pending: dict = {}

        def long_request() -> None:
            pending["r"] = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1500,
                                                                     "ignore_eos": True}, timeout=60)

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 120  # a hang guard: the kill comes once the engine runs the request
        while metric(httpx.get(url + "/metrics", timeout=30).text, "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.02)
        # the engine core, by its process name (with --api-server-count > 1, the default on GPU machines of 4+
        # cores, the server's children are API processes too)
        engines = [p for p in _children(proc.pid) if open(f"/proc/{p}/comm").read().startswith("pagedllm-core")]
        assert len(engines) == 1
        os.kill(engines[0], signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the pending request hung after the engine died"
        assert pending["r"].status_code == 503 and "engine" in pending["r"].json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503
        new = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                         timeout=10)
        assert new.status_code == 503 and new.json()["error"]["type"] == "service_unavailable_error"
        stream = httpx.post(url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=10)
        assert stream.status_code == 503
        # the dashboard still answers, and says why
        with httpx.stream("GET", url + "/dashboard/events", timeout=30) as r:
            assert r.status_code == 200
            event = next(json.loads(x[len("data: "):]) for x in r.iter_lines() if x.startswith("data: "))
        assert event["status"] == "engine_dead" and "engine" in event["status_detail"], event["status_detail"]
    finally:
        stop(proc)
