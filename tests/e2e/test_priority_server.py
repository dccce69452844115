"""`pagedllm serve --scheduling-policy priority`: the `priority` field of both endpoints orders admission (lower
first, ties by arrival); the shared fcfs server refuses a non-zero priority naming the flag (test_request_fields.py).

Deterministic: with --max-num-seqs 1 one request runs at a time. A long request more urgent than all of them holds
the only seat while the others queue (the waiting gauge says when they all do); aborting it (the client leaves) frees
the seat, and the queue is served strictly one by one, so the order answers come back in is the scheduler's
admission order. A less urgent long request instead gives its seat to an urgent arrival at once (preempted, then
resumed to its end)."""
from __future__ import annotations

import subprocess
import threading
import time

import httpx
import pytest
from e2e_helpers import API_KEY, Server, cli, metric, stop

from pagedllm.entrypoints.server_process import free_port, wait_healthy

CMPL, CHAT, RESP = "/v1/completions", "/v1/chat/completions", "/v1/responses"


@pytest.fixture(scope="module")
def priority_server(smollm2_hf_dir, e2e_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("priority-server")
    port = free_port()
    log_path = str(tmp / "server.log")
    cmd = [cli("pagedllm"), "serve", smollm2_hf_dir, "--port", str(port), "--api-key", API_KEY,
           "--served-model-name", "smol", "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
           "--max-num-seqs", "1", "--scheduling-policy", "priority"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e2e_env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path=log_path)
        yield Server(url, port, smollm2_hf_dir, proc, log_path)
    finally:
        stop(proc)


def _wait_waiting(http: httpx.Client, count: int, hang_guard_s: float = 120) -> None:
    deadline = time.monotonic() + hang_guard_s  # a hang guard, not a timing assertion
    while metric(http.get("/metrics").text, "vllm:num_requests_waiting") < count:
        assert time.monotonic() < deadline, f"{count} requests never waited"
        time.sleep(0.05)


def _body(path: str, priority: int, text: str) -> dict:
    if path == RESP:  # (the Responses API ignored priority, as an unknown field, before)
        return {"input": text, "model": "smol", "max_output_tokens": 4, "temperature": 0, "priority": priority}
    base = {"messages": [{"role": "user", "content": text}]} if path == CHAT else {"prompt": text}
    return {**base, "model": "smol", "max_tokens": 4, "temperature": 0, "priority": priority}


def test_priority_orders_the_waiting_queue(priority_server: Server) -> None:
    finished: list[str] = []
    lock = threading.Lock()

    def send(name: str, path: str, priority: int) -> None:
        with priority_server.client() as c:
            r = c.post(path, json=_body(path, priority, f"Request {name} says"))
        assert r.status_code == 200, r.text
        with lock:
            finished.append(name)

    with priority_server.client() as http:
        long_body = {"prompt": "Count slowly:", "model": "smol", "max_tokens": 400, "ignore_eos": True,
                     "stream": True, "priority": -100}  # (more urgent than every request queued behind it)
        threads = []
        with http.stream("POST", CMPL, json=long_body) as blocker:
            lines = blocker.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it runs: it holds the one seat
            # Queued in this order (each waits before the next is sent): arrival order is known.
            for i, (name, path, priority) in enumerate([("low", CMPL, 5), ("tie-first", CHAT, 1), ("urgent", CMPL, -2),
                                                        ("tie-second", CMPL, 1), ("responses", RESP, 3)]):
                t = threading.Thread(target=send, args=(name, path, priority))
                t.start()
                threads.append(t)
                _wait_waiting(http, i + 1)
        # The client left: the long request is aborted and the queue runs, one request at a time.
        for t in threads:
            t.join(120)
    assert finished == ["urgent", "tie-first", "tie-second", "responses", "low"]


def test_an_urgent_request_takes_the_seat_of_a_less_urgent_one(priority_server: Server) -> None:
    """The one seat held by a long, less urgent stream: an urgent request runs at once (the stream is preempted) and
    answers while the stream is still going; the stream then resumes to all of its tokens."""
    with priority_server.client() as http:
        preempted = metric(http.get("/metrics").text, "vllm:num_preemptions_total")
        long_body = {"prompt": "Count slowly:", "model": "smol", "max_tokens": 120, "ignore_eos": True,
                     "stream": True, "priority": 100, "stream_options": {"include_usage": True}}
        with http.stream("POST", CMPL, json=long_body) as blocker:
            lines = blocker.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it holds the one seat
            urgent = http.post(CMPL, json=_body(CMPL, 0, "Urgent says"))
            assert urgent.status_code == 200 and urgent.json()["usage"]["completion_tokens"] == 4
            rest = [line for line in lines if line.startswith("data: ")]  # the stream goes on to its end
        assert rest[-1] == "data: [DONE]" and '"completion_tokens":120' in rest[-2]
        assert metric(http.get("/metrics").text, "vllm:num_preemptions_total") > preempted


@pytest.mark.parametrize("path", [CMPL, CHAT, RESP])
def test_priority_accepted_and_checked(priority_server: Server, path: str) -> None:
    with priority_server.client() as http:
        r = http.post(path, json=_body(path, -7, "Hello"))
        assert r.status_code == 200, r.text
        for bad in ("soon", 10 ** 30):
            r = http.post(path, json=_body(path, bad, "Hello"))
            assert r.status_code == 400 and "priority" in r.text, r.text
