"""Engine faults: the engine-core process killed -> /health 503, requests in flight end with an error (an SSE
error event + [DONE], or a 503), and the API process exits non-zero after --engine-dead-grace-period so an
orchestrator restarts the replica."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx

from robust_helpers import completion_body, launch, metric, sse_events, stop


def _engine_pid(server_pid: int) -> int:
    """The engine core among the server's children (the API server processes too, with --api-server-count > 1)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server_pid)], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split() if open(f"/proc/{p.strip()}/comm").read().startswith("pagedllm-core")]
    assert len(pids) == 1, pids
    return pids[0]


def test_killed_engine_fails_in_flight_then_the_server_exits_1(tiny_llama_dir: str, robust_env: dict,
                                                                 tmp_path) -> None:
    grace = 3.0
    server = launch(tiny_llama_dir, ["--engine-dead-grace-period", str(grace), "--max-num-seqs", "1"], robust_env,
                    str(tmp_path / "server.log"))
    try:
        results: dict = {}
        started = threading.Event()

        def streaming() -> None:
            with httpx.stream("POST", server.url + "/v1/completions", json=completion_body(450, True), timeout=60) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
                results["stream"] = (r.status_code, sse_events(lines))

        def queued() -> None:  # waits behind the stream (one sequence at a time)
            results["queued"] = httpx.post(server.url + "/v1/completions", json=completion_body(450, False),
                                           timeout=60)

        threads = [threading.Thread(target=streaming), threading.Thread(target=queued)]
        threads[0].start()
        assert started.wait(60)
        threads[1].start()
        # The queued request is in the server (one sequence at a time: it waits behind the stream) before the kill.
        deadline = time.monotonic() + 60  # a hang guard, not a speed bound
        while metric(httpx.get(server.url + "/metrics", timeout=10).text, "vllm:num_requests_waiting") < 1:
            assert time.monotonic() < deadline, "the second request never reached the engine"
            time.sleep(0.02)
        killed_at = time.monotonic()
        os.kill(_engine_pid(server.proc.pid), signal.SIGKILL)
        # /health turns 503 once the API process notices, and the process stays up for the grace period after
        # that: polled from the kill on, the 503 must come from a live server (a refused connection fails here).
        while (health := httpx.get(server.url + "/health", timeout=10).status_code) == 200:
            assert time.monotonic() < deadline + 60, "/health stayed 200 after the engine died"
            time.sleep(0.02)
        assert health == 503
        for t in threads:
            t.join(60)  # a hang guard
            assert not t.is_alive(), "a request hung after the engine died"
        status, events = results["stream"]
        assert status == 200 and events[-1] == "[DONE]"
        assert any("error" in e and "engine" in e["error"]["message"] for e in events[:-1] if isinstance(e, dict))
        assert results["queued"].status_code == 503
        assert results["queued"].json()["error"]["type"] == "service_unavailable_error"
        assert server.proc.wait(grace + 60) == 1
        assert time.monotonic() - killed_at >= grace - 0.5  # it waited out the grace period (a lower bound)
        assert "exiting in 3 s so the replica is restarted" in server.log()
    finally:
        stop(server.proc, signal.SIGKILL)
