"""Graceful shutdown of a replica, through the container's entry command (deploy/docker-entrypoint.sh, run
outside Docker) and its health probe (deploy/healthcheck.py): SIGTERM -> /health 503 and new requests 503
while in-flight requests finish; the process exits 0. Past --shutdown-timeout the rest end with an error."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from robust_helpers import REPO_ROOT, completion_body, launch, sse_events, stop

ENTRYPOINT = os.path.join(REPO_ROOT, "deploy", "docker-entrypoint.sh")
HEALTHCHECK = os.path.join(REPO_ROOT, "deploy", "healthcheck.py")


def _healthcheck(port: int, env: dict) -> int:
    return subprocess.run([sys.executable, HEALTHCHECK], env={**env, "PAGEDLLM_PORT": str(port)},
                          capture_output=True, timeout=30).returncode


def _stream(url: str, body: dict, out: list, started: threading.Event) -> None:
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        out.append(r.status_code)
        if r.status_code != 200:  # refused before the stream started: one JSON error body
            out.append(json.loads(r.read()))
            return
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith("data: "):
                started.set()
    out.append(sse_events(lines))


def _start_streams(url: str, count: int, body: dict) -> tuple[list, list]:
    results, threads = [], []
    for _ in range(count):
        out: list = []
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(url, body, out, started), daemon=True)
        t.start()
        results.append((out, started))
        threads.append(t)
    for _, started in results:
        assert started.wait(60), "a stream did not start"
    return [r[0] for r in results], threads


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_llama_dir: str, robust_env: dict, tmp_path) -> None:
    # The entry command runs `pagedllm` from PATH, as in the image: this interpreter's bin directory has it.
    env = dict(robust_env, PATH=os.pathsep.join([os.path.dirname(sys.executable), robust_env.get("PATH", "")]))
    server = launch(tiny_llama_dir, ["--shutdown-timeout", "60"], env, str(tmp_path / "server.log"),
                    command=["sh", ENTRYPOINT])
    try:
        assert _healthcheck(server.port, robust_env) == 0
        max_tokens = 400
        results, threads = _start_streams(server.url, 4, completion_body(max_tokens, stream=True))
        # `exec` in the entry command: the signal goes straight to pagedllm (proc.pid is the server itself)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health did not turn 503 after SIGTERM"
            time.sleep(0.05)
        assert _healthcheck(server.port, robust_env) == 1
        new = httpx.post(server.url + "/v1/completions", json=completion_body(4, stream=False), timeout=10)
        assert new.status_code == 503 and "shutting down" in new.json()["error"]["message"]
        assert server.proc.poll() is None, "the server exited with requests in flight"
        for t in threads:
            t.join(60)
        for status, events in results:
            assert status == 200 and events[-1] == "[DONE]"
            usage = events[-2]["usage"]
            assert usage["completion_tokens"] == max_tokens, usage
            finishes = [ch["finish_reason"] for e in events[:-1] for ch in e["choices"] if ch["finish_reason"]]
            assert finishes == ["length"]
        assert server.proc.wait(30) == 0
        assert "drained: no requests in flight" in server.log()
    finally:
        stop(server.proc, signal.SIGKILL)


def test_shutdown_timeout_ends_what_is_left_with_an_error(tiny_llama_dir: str, robust_env: dict, tmp_path) -> None:
    # one sequence at a time: the queue of 24 x 400 tokens cannot finish within the 1 s timeout (an idle CI core
    # runs the tiny model at ~1,600 tok/s: 6 requests could all finish in time)
    server = launch(tiny_llama_dir, ["--shutdown-timeout", "1", "--max-num-seqs", "1"], robust_env,
                    str(tmp_path / "server.log"))
    try:
        results: list[list] = []
        threads = []
        for _ in range(24):
            out: list = []
            t = threading.Thread(target=_stream, args=(server.url, completion_body(400, stream=True), out,
                                                       threading.Event()), daemon=True)
            t.start()
            results.append(out)
            threads.append(t)
        time.sleep(0.5)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert time.monotonic() - t0 < 15
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        done = in_stream_errors = refused = 0
        for status, events in results:
            if status == 503:  # still queued when the timeout hit: a 503 before any byte of the stream
                assert "shutting down" in events["error"]["message"]
                refused += 1
                continue
            assert status == 200
            assert events[-1] == "[DONE]", "a stream was cut off instead of ending with an error event"
            errors = [e["error"]["message"] for e in events[:-1] if "error" in e]
            finishes = [ch["finish_reason"] for e in events[:-1] for ch in e.get("choices", []) if ch["finish_reason"]]
            if errors:
                assert "shutting down" in errors[0]
                in_stream_errors += 1
            elif finishes == ["abort"]:  # ended by the timeout, reported as vLLM does
                in_stream_errors += 1
            else:
                assert finishes == ["length"] and events[-2]["usage"]["completion_tokens"] == 400, events[-3:]
                done += 1
        counts = (done, in_stream_errors, refused)
        assert sum(counts) == 24 and in_stream_errors + refused >= 1, counts
        assert "shutdown timeout: ending" in server.log()
    finally:
        stop(server.proc, signal.SIGKILL)
