"""Real nginx, started from the repository's gateway config (deploy/nginx), in front of two real CPU replicas
on loopback ports: requests spread over both, the rate limit's burst, SSE passed through token by token (the
completions' and the dashboard's), and a replica killed mid-run costing only what it had in flight. Asserted on counts and order; the timeouts are hang
guards."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from robust_helpers import REPO_ROOT, completion_body, metric, sse_events, stop

from pagedllm.entrypoints.server_process import free_port, nginx_gateway_config, start_nginx, wait_healthy

NGINX_DIR = os.path.join(REPO_ROOT, "deploy", "nginx")
FLAGS = ["--max-num-seqs", "32", "--kv-cache-memory-bytes", str(64 << 20)]

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None and not os.path.exists("/usr/sbin/nginx"),
                                reason="nginx is not installed (.ci/run installs it: apt-get install nginx)")


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir: str, robust_env: dict, tmp_path_factory: pytest.TempPathFactory):
    import subprocess

    from robust_helpers import BIN

    tmp = tmp_path_factory.mktemp("gateway")
    replicas = []
    for i in range(2):
        port = free_port()
        log_path = str(tmp / f"replica{i}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen([os.path.join(BIN, "pagedllm"), "serve", tiny_llama_dir, "--port", str(port),
                                     *FLAGS], stdout=log, stderr=subprocess.STDOUT, env=robust_env)
        replicas.append((f"http://127.0.0.1:{port}", port, proc, log_path))
    nginx = None
    try:
        for url, _, proc, log_path in replicas:
            wait_healthy(proc, url, timeout_s=180, log_path=log_path)
        listen = free_port()
        conf = nginx_gateway_config(NGINX_DIR, str(tmp / "nginx"), listen, [r[1] for r in replicas])
        nginx = start_nginx(conf, str(tmp / "nginx.log"))
        url = f"http://127.0.0.1:{listen}"
        deadline = time.monotonic() + 120  # a hang guard
        while True:
            assert nginx.poll() is None, open(tmp / "nginx.log").read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "nginx did not come up"
            time.sleep(0.1)
        yield {"url": url, "replicas": replicas, "nginx": nginx}
    finally:
        if nginx is not None:
            stop(nginx, signal.SIGTERM, wait_s=10)
        for _, _, proc, _ in replicas:
            stop(proc)


def _one(client: httpx.Client, i: int) -> tuple[bool, str]:
    stream = i % 2 == 0
    chat = i % 4 < 2
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = completion_body(8, stream)
    if chat:
        body.pop("prompt")
        body["messages"] = [{"role": "user", "content": f"question {i}"}]
    if not stream:
        r = client.post(path, json=body)
        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        return ok, r.text[:200]
    with client.stream("POST", path, json=body) as r:
        events = sse_events(r.iter_lines()) if r.status_code == 200 else []
    ok = bool(events) and events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 8
    return ok, str(events[-3:])[:200]


class Pacer:
    """Hands out start times at `rate` per second: keeps a test's load under the gateway's 50 r/s limit."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate
        self.next = time.monotonic()
        self.lock = threading.Lock()

    def wait(self) -> None:
        with self.lock:
            slot = self.next = max(self.next + self.interval, time.monotonic())
        time.sleep(max(0.0, slot - time.monotonic()))


def _served(replica_url: str) -> float:
    return metric(httpx.get(replica_url + "/metrics", timeout=10).text, "vllm:request_success_total")


def test_200_mixed_requests_all_succeed_on_both_replicas(gateway: dict) -> None:
    before = [_served(r[0]) for r in gateway["replicas"]]
    pacer = Pacer(40)

    def paced(client: httpx.Client, i: int) -> tuple[bool, str]:
        pacer.wait()
        return _one(client, i)

    with httpx.Client(base_url=gateway["url"], timeout=60) as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: paced(client, i), range(200)))
    failures = [detail for ok, detail in results if not ok]
    assert not failures, failures[:3]
    served = [_served(r[0]) - b for r, b in zip(gateway["replicas"], before)]
    assert sum(served) == 200 and min(served) > 0, served
    # /metrics stays internal; the probe path is open
    assert httpx.get(gateway["url"] + "/metrics", timeout=10).status_code == 403
    assert httpx.get(gateway["url"] + "/health", timeout=10).status_code == 200


def _running(gateway: dict) -> float:
    return sum(metric(httpx.get(r[0] + "/metrics", timeout=30).text, "vllm:num_requests_running")
               for r in gateway["replicas"])


def test_sse_passes_through_token_by_token(gateway: dict) -> None:
    """Every token, in order, through the gateway, and the stream passed on while it is generated: the first event
    reaches the client while its replica still runs the request (a proxy that buffered the response would hold
    it until the end; 450 tokens are ~450 engine steps, against the two /metrics reads of the check). The events'
    running token counts (continuous usage stats) rise chunk by chunk to the total, and the text is the one the
    same greedy request gets without streaming. How evenly the chunks come is benchmarks/stream_smoothness.py's."""
    max_tokens = 450
    body = completion_body(max_tokens, stream=True, temperature=0.0,
                           stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert _running(gateway) == 0
    lines, running_at_first_event = [], None
    with httpx.stream("POST", gateway["url"] + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            lines.append(line)
            if running_at_first_event is None and line.startswith("data: "):
                running_at_first_event = _running(gateway)
    assert running_at_first_event == 1, "the first event came only after the replica had finished the request"
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(set(counts)) and counts[-1] == max_tokens, counts  # rising: in order, none repeated
    assert [ch["finish_reason"] for e in chunks for ch in e["choices"]][-1] == "length"
    whole = httpx.post(gateway["url"] + "/v1/completions", timeout=120,
                       json=completion_body(max_tokens, stream=False, temperature=0.0)).json()
    assert "".join(ch["text"] for e in chunks for ch in e["choices"]) == whole["choices"][0]["text"]


def test_dashboard_stream_passes_through_as_it_comes(gateway: dict) -> None:
    """GET /dashboard and its event stream through the gateway: the page, then events in order, each passed on while
    the stream is open (it never ends, so a proxy that held responses until their end would pass nothing). The
    events count the pages listening on their replica: a second listener opened on that replica directly shows in
    the gateway stream's events while it is open, and its leaving once it has closed (count-based, no timing)."""
    import json

    page = httpx.get(gateway["url"] + "/dashboard", timeout=30)
    assert page.status_code == 200 and 'id="kv-grid"' in page.text
    deadline = time.monotonic() + 120  # a hang guard
    seqs = []
    with httpx.stream("GET", gateway["url"] + "/dashboard/events", timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()

        def next_event() -> dict:
            for line in lines:
                assert time.monotonic() < deadline, "the stream stalled (hang guard)"
                if line.startswith("data: "):
                    event = json.loads(line[len("data: "):])
                    seqs.append(event["seq"])
                    return event
            raise AssertionError("the stream ended")

        first = next_event()
        assert first["clients"] == 1
        replica = next(url for url, _, proc, _ in gateway["replicas"] if proc.pid == first["model"]["api_pid"])
        with httpx.stream("GET", replica + "/dashboard/events", timeout=60) as direct:
            assert any(line.startswith("data: ") for line in direct.iter_lines())  # it listens now
            while next_event()["clients"] != 2:
                pass
        while next_event()["clients"] != 1:
            pass
    assert seqs == sorted(set(seqs)) and len(seqs) >= 3


async def _burst(url: str, count: int) -> tuple[list[int], float]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        t0 = time.monotonic()
        responses = await asyncio.gather(*[client.get("/v1/models") for _ in range(count)])
        return [r.status_code for r in responses], time.monotonic() - t0


def test_rate_limit_burst_gets_503_for_the_excess(gateway: dict) -> None:
    time.sleep(2.5)  # let the earlier tests' requests drain from the 50 r/s bucket (burst 100)
    statuses, elapsed = asyncio.run(_burst(gateway["url"], 300))
    ok, limited = statuses.count(200), statuses.count(503)
    assert ok + limited == 300, sorted(set(statuses))
    assert ok >= 101, (ok, elapsed)  # 1 + the burst of 100 at once
    # nginx cannot admit more than the burst plus 50/s over the burst's span, which the client's clock bounds from
    # above (a slow machine only widens this; +5: nginx's millisecond clock is cached per event-loop turn)
    assert ok <= 101 + 50 * elapsed + 5 and limited >= 1, (ok, limited, elapsed)


def test_killed_replica_costs_only_its_in_flight_requests(gateway: dict) -> None:
    """Phases by counts, not durations: 8 clients run until 16 requests are answered, one replica is SIGKILLed
    (and reaped: it is gone for whatever is sent later), then each client sends 3 more. Failures may only be
    requests in flight while the replica died; everything sent after it succeeds, on the survivor."""
    time.sleep(2.5)  # empty the rate-limit bucket (it leaks at 50 r/s of wall time; burst 100)
    _, _, victim, _ = gateway["replicas"][0]
    survivor_url = gateway["replicas"][1][0]
    survivor_before = _served(survivor_url)
    records: list[tuple[float, float, bool]] = []  # (start, end, ok): monotonic times, compared for order only
    lock = threading.Lock()
    dead: list[float] = []  # the time the victim had been reaped
    pacer = Pacer(40)
    workers, after_each = 8, 3

    def worker(k: int) -> None:
        sent_after = 0
        with httpx.Client(base_url=gateway["url"], timeout=120) as client:
            i = k
            while sent_after < after_each:
                pacer.wait()
                start = time.monotonic()
                after = bool(dead) and start > dead[0]
                try:
                    ok, _ = _one(client, i)
                except httpx.HTTPError:
                    ok = False
                with lock:
                    records.append((start, time.monotonic(), ok))
                sent_after += after
                i += workers

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(workers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120  # a hang guard
    while len(records) < 16:
        assert time.monotonic() < deadline, records
        time.sleep(0.01)
    signalled = time.monotonic()
    victim.send_signal(signal.SIGKILL)  # its engine process follows (parent watchdog)
    victim.wait(60)  # a hang guard
    dead.append(time.monotonic())
    for t in threads:
        t.join(300)  # a hang guard
        assert not t.is_alive()
    failed = [(s, e) for s, e, ok in records if not ok]
    after = [ok for s, e, ok in records if s > dead[0]]
    # a failure overlaps the replica's death: started before it was gone, still running when it was signalled
    assert all(s <= dead[0] and e >= signalled for s, e in failed), (failed, signalled, dead)
    assert len(after) >= workers * after_each and all(after), after
    assert _served(survivor_url) - survivor_before >= len(after)
    assert httpx.get(gateway["url"] + "/health", timeout=30).status_code == 200
