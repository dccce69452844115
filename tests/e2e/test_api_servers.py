"""`pagedllm serve --api-server-count 2`: two API server processes on one port over one engine core (SmolLM2 on
the CPU). Every request is answered once, by the process whose client sent it, with the offline engine's text;
both processes take requests (told apart by `pagedllm:api_server_requests_total{api_server}`); aborts from either
process reach the engine (its own count of aborted requests); the /metrics sums match the requests sent; SIGTERM
drains both processes; a killed API process stops the server with exit code 1; a killed engine core is reported as
with one API process. Counts and outcomes only: every deadline is a hang guard."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import tempfile
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai", reason="these tests call the server with the openai SDK too")

from e2e_helpers import (API_KEY, MAX_MODEL_LEN, SERVED_NAME, Server, cli, metric, stop,  # noqa: E402
                         wait_all_serving)

from pagedllm.entrypoints.server_process import free_port, wait_healthy  # noqa: E402

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [f"Fact {i}: the number {i * 11 + 2} is" for i in range(12)]
MAX_TOKENS = 12


def _start(smollm2_hf_dir: str, env: dict, log_path: str, *flags: str, count: int = 2) -> Server:
    port = free_port()
    cmd = [cli("pagedllm"), "serve", smollm2_hf_dir, "--port", str(port), "--api-key", API_KEY,
           "--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN),
           "--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "64", "--api-server-count", str(count), *flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    server = Server(url, port, smollm2_hf_dir, proc, log_path, api_servers=count)
    try:
        wait_healthy(proc, url, log_path=log_path)
        wait_all_serving(server)
    except BaseException:
        stop(proc)
        raise
    return server


@pytest.fixture(scope="module")
def api2(smollm2_hf_dir: str, e2e_env: dict, tmp_path_factory: pytest.TempPathFactory):
    # A drain long enough for the last test's streams to finish on a loaded machine (not the 30 s default).
    server = _start(smollm2_hf_dir, e2e_env, str(tmp_path_factory.mktemp("api2") / "server.log"),
                    "--shutdown-timeout", "600")
    try:
        yield server
    finally:
        stop(server.proc)


def _metrics(server: Server) -> str:
    # a fresh connection each time: any of the processes may answer, and each must give the same totals
    return httpx.get(server.url + "/metrics", timeout=60).text


def _per_process(text: str) -> dict[str, float]:
    return {p: metric(text, "pagedllm:api_server_requests_total", api_server=p) for p in ("0", "1")}


def _success(text: str, reason: str = "") -> float:
    total = 0.0
    for r in ([reason] if reason else ["stop", "length", "abort"]):
        total += metric(text, "vllm:request_success_total", finished_reason=r)
    return total


def _process_names(pid: int) -> dict[str, int]:
    """The server's child processes by name (`pagedllm-api-0`, `pagedllm-core-0`, ...)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    names = {}
    for child in out.split():
        try:
            with open(f"/proc/{child}/comm") as f:
                names[f.read().strip()] = int(child)
        except OSError:
            pass
    return names


async def _one(kind: str, server: Server, i: int) -> tuple[str, str, int, int]:
    """One request on its own connection, by the openai SDK or raw HTTP; (its id, text, prompt and completion
    tokens). The id is ours (the request_id field), so an answer carrying another request's output is caught."""
    rid = f"api2-{kind}-{i}"
    prompt = PROMPTS[i % len(PROMPTS)]
    if kind == "raw-stream":
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=300) as c:
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, "request_id": rid}
            pieces, ids, usage = [], set(), None
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        ids.add(chunk["id"])
                        usage = chunk.get("usage") or usage
                        pieces += [ch["text"] for ch in chunk["choices"]]
            assert ids == {f"cmpl-{rid}"}  # vLLM's id: "cmpl-<request_id>"
            return rid, "".join(pieces), usage["prompt_tokens"], usage["completion_tokens"]
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as client:
        if kind == "sdk":
            r = await client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, extra_body={"request_id": rid})
            assert r.id == f"cmpl-{rid}"
            return rid, r.choices[0].text, r.usage.prompt_tokens, r.usage.completion_tokens
        stream = await client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"request_id": rid})
        pieces, ids, usage = [], set(), None
        async for chunk in stream:
            ids.add(chunk.id)
            usage = chunk.usage or usage
            pieces += [ch.text for ch in chunk.choices]
        assert ids == {f"cmpl-{rid}"}
        return rid, "".join(pieces), usage.prompt_tokens, usage.completion_tokens


def test_every_request_answered_once_by_both_processes(api2: Server, offline_llm) -> None:
    from pagedllm import SamplingParams

    before = _metrics(api2)
    kinds = ["sdk", "sdk-stream", "raw-stream"]
    jobs = [(kind, i) for i in range(16) for kind in kinds]  # 48 requests, each on its own connection

    async def run_all() -> list:
        return await asyncio.gather(*(_one(kind, api2, i) for kind, i in jobs))

    results = asyncio.run(run_all())
    offline = offline_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    expected = {p: o.outputs[0].text for p, o in zip(PROMPTS, offline)}
    for (kind, i), (rid, text, _, _) in zip(jobs, results):
        assert rid == f"api2-{kind}-{i}"
        assert text == expected[PROMPTS[i % len(PROMPTS)]], (kind, i, text)
    after = _metrics(api2)
    taken = {p: _per_process(after)[p] - _per_process(before)[p] for p in ("0", "1")}
    assert taken["0"] >= 1 and taken["1"] >= 1, taken  # both processes served some
    assert taken["0"] + taken["1"] == len(jobs)  # each request taken by exactly one process
    assert _success(after) - _success(before) == len(jobs)  # and finished once
    generated = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert generated == sum(r[3] for r in results)
    prompted = metric(after, "vllm:prompt_tokens_total") - metric(before, "vllm:prompt_tokens_total")
    assert prompted == sum(r[2] for r in results)
    histogram = metric(after, "vllm:e2e_request_latency_seconds_count") - metric(
        before, "vllm:e2e_request_latency_seconds_count")
    assert histogram == len(jobs)
    # one view whichever process answers the scrape
    views = {(_success(t), metric(t, "vllm:generation_tokens_total"), tuple(_per_process(t).values()))
             for t in (_metrics(api2) for _ in range(8))}
    assert len(views) == 1, views


def test_aborts_from_either_process_reach_the_engine(api2: Server) -> None:
    before = _metrics(api2)
    streams = []  # (client, response) of streams left open after their first token
    deadline = time.monotonic() + 300  # a hang guard
    try:
        while True:
            client = httpx.Client(base_url=api2.url, headers=HEADERS, timeout=120)
            r = client.send(client.build_request("POST", "/v1/completions", json={
                "model": SERVED_NAME, "prompt": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}), stream=True)
            streams.append((client, r))
            assert r.status_code == 200
            assert any(line.startswith("data: {") for line in _first_lines(r))
            taken = {p: v - _per_process(before)[p] for p, v in _per_process(_metrics(api2)).items()}
            if min(taken.values()) >= 2:  # both processes hold streams to abort
                break
            assert len(streams) < 40 and time.monotonic() < deadline, taken
    finally:
        for client, r in streams:  # the clients go away mid-stream
            r.close()
            client.close()
    aborted = len(streams)
    while True:
        now = _metrics(api2)
        done = (metric(now, "pagedllm:engine_aborted_requests_total")
                - metric(before, "pagedllm:engine_aborted_requests_total"))
        if done >= aborted and metric(now, "vllm:num_requests_running") == 0:
            break
        assert time.monotonic() < deadline, (done, aborted)
        time.sleep(0.1)
    assert done == aborted  # the engine core aborted each one: none ran on to its 1000 tokens
    assert _success(now, "abort") - _success(before, "abort") == aborted
    assert metric(now, "vllm:kv_cache_usage_perc") == 0


def _first_lines(r: httpx.Response):
    for line in r.iter_lines():
        yield line
        if line.startswith("data: {"):
            return


def test_a_step_is_one_iteration_tokens_sample_over_both_processes(api2: Server) -> None:
    """vllm:iteration_tokens_total has one sample per engine step, also when the step's requests came through both
    API processes (each observed its own part: a step was two samples, each of part of its tokens). A long stream
    runs on one process; a short request on the other shares each of its steps: every such step is one sample of
    at least 2 tokens (as two, each was a sample of 1)."""
    short = 6

    def per_process() -> list[float]:
        text = _metrics(api2)
        return [metric(text, "pagedllm:api_server_requests_total", api_server=str(i)) for i in (0, 1)]

    def samples_over_one() -> float:
        text = _metrics(api2)
        return (metric(text, "vllm:iteration_tokens_total_count")
                - metric(text, "vllm:iteration_tokens_total_bucket", le="1.0"))

    with httpx.Client(base_url=api2.url, headers=HEADERS, timeout=120) as long_client:
        before = per_process()
        with long_client.stream("POST", "/v1/completions", json={"prompt": "Tell a long story.", "max_tokens": 900,
                                                                 "ignore_eos": True, "stream": True}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it runs
            long_on = [a - b for a, b in zip(per_process(), before)].index(1)
            for _ in range(30):  # a hang guard: new connections until one reaches the other process
                before, over_one = per_process(), samples_over_one()
                with httpx.Client(base_url=api2.url, headers=HEADERS, timeout=120) as c:
                    r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": short, "ignore_eos": True})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == short
                if [a - b for a, b in zip(per_process(), before)].index(1) != long_on:
                    break
            else:
                raise AssertionError("every connection reached the long stream's API process")
            assert samples_over_one() - over_one >= short
            stream.close()


def test_sigterm_drains_both_processes(api2: Server) -> None:
    """The module's last test on its server: SIGTERM while both processes stream; every stream ends whole."""
    results: list = []
    before = _per_process(_metrics(api2))
    opened = threading.Semaphore(0)

    def stream() -> None:
        with httpx.Client(base_url=api2.url, headers=HEADERS, timeout=300) as c, c.stream(
                "POST", "/v1/completions", json={"model": SERVED_NAME, "prompt": "Count slowly:", "max_tokens": 200,
                                                 "ignore_eos": True, "stream": True}) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: {") and not lines:
                    opened.release()
                if line:
                    lines.append(line)
            results.append((r.status_code, lines))

    threads = []
    deadline = time.monotonic() + 300  # a hang guard
    while True:
        threads.append(threading.Thread(target=stream, daemon=True))
        threads[-1].start()
        assert opened.acquire(timeout=300)
        now = _per_process(_metrics(api2))
        if min(now[p] - before[p] for p in now) >= 1:
            break
        assert len(threads) < 40 and time.monotonic() < deadline
    api2.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(300)
        assert not t.is_alive()
    assert api2.proc.wait(120) == 0
    assert len(results) == len(threads)
    for status, lines in results:
        assert status == 200 and lines[-1] == "data: [DONE]"
        assert sum(1 for line in lines if '"finish_reason":"length"' in line) == 1
    log = api2.log()
    assert "[api 0] pagedllm.api_server: SIGTERM: draining" in log and "[api 1] pagedllm.api_server: SIGTERM" in log
    assert log.count("drained: no requests in flight") + log.count("shutdown timeout") == 2


def test_a_killed_api_process_stops_the_server_with_exit_code_1(smollm2_hf_dir: str, e2e_env: dict, tmp_path) -> None:
    server = _start(smollm2_hf_dir, e2e_env, str(tmp_path / "server.log"))
    try:
        names = _process_names(server.proc.pid)
        assert {"pagedllm-api-0", "pagedllm-api-1", "pagedllm-core-0"} <= set(names), names
        os.kill(names["pagedllm-api-1"], signal.SIGKILL)
        assert server.proc.wait(120) == 1  # a hang guard
        log = server.log()
        assert f"API server 1 (pid {names['pagedllm-api-1']}) died (killed by SIGKILL): stopping the server" in log
        for pid in names.values():  # nothing is left behind
            assert _gone(pid), pid
    finally:
        stop(server.proc)


@pytest.mark.parametrize("count", [1, 2])
def test_a_killed_server_leaves_no_channel_files(smollm2_hf_dir: str, e2e_env: dict, tmp_path, count: int) -> None:
    """SIGKILL to the process the user started (a replica killed, as behind the gateway): its children exit (their
    parent watchdog) and remove the channels' directory it could not; its socket and metrics files stayed in /tmp."""
    holder = tempfile.TemporaryDirectory(prefix="pgl-")  # short: a socket path holds at most 107 bytes
    tmp = pathlib.Path(holder.name)

    def channels() -> list[str]:
        return [p.name for p in tmp.iterdir() if p.name.startswith("pagedllm-ipc-")]

    server = _start(smollm2_hf_dir, {**e2e_env, "TMPDIR": str(tmp)}, str(tmp_path / "server.log"), count=count)
    try:
        names = _process_names(server.proc.pid)
        assert "pagedllm-core-0" in names or "pagedllm-api-0" in names, names
        assert len(channels()) == 1
        with httpx.Client(base_url=server.url, headers=HEADERS, timeout=60) as c:
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        server.proc.kill()
        server.proc.wait(60)
        for pid in names.values():  # every child exits (the engine core under API process 0 too)
            assert _gone(pid), pid
        assert channels() == []
    finally:
        stop(server.proc)
        holder.cleanup()


def test_a_killed_engine_core_is_reported_and_the_server_exits_1(smollm2_hf_dir: str, e2e_env: dict,
                                                                 tmp_path) -> None:
    server = _start(smollm2_hf_dir, e2e_env, str(tmp_path / "server.log"), "--engine-dead-grace-period", "2")
    try:
        pending: dict = {}

        def long_request() -> None:
            with httpx.Client(base_url=server.url, headers=HEADERS, timeout=120) as c:
                pending["r"] = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 900, "ignore_eos": True})

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 120  # a hang guard: the kill comes once the engine runs the request
        while metric(_metrics(server), "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.05)
        names = _process_names(server.proc.pid)
        os.kill(names["pagedllm-core-0"], signal.SIGKILL)
        t.join(60)
        assert not t.is_alive(), "the pending request hung after the engine died"
        assert pending["r"].status_code == 503 and "engine" in pending["r"].json()["error"]["message"]
        while httpx.get(server.url + "/health", timeout=10).status_code == 200:  # up, and saying so, until exit
            assert time.monotonic() < deadline + 60, "/health stayed 200 after the engine died"
            time.sleep(0.05)
        assert server.proc.wait(120) == 1  # a hang guard
        log = server.log()
        assert f"the engine core (pid {names['pagedllm-core-0']}) died (killed by SIGKILL)" in log
        # each API process learned it and ended itself after the grace period, as one API process does
        assert log.count("exiting in 2 s so the replica is restarted") == 2
    finally:
        stop(server.proc)


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 30  # a hang guard
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):
                    return True  # a zombie: exited, not reaped yet
        except OSError:
            return True
        time.sleep(0.1)
    return False


def _serve_two_cores(model: str, env: dict, tmp_path, *flags: str) -> tuple[subprocess.Popen, str, int, str]:
    """`pagedllm serve` of the tiny model over two data-parallel engine cores on the CPU: (process, url, port,
    log path); the caller waits for it and stops it."""
    port = free_port()
    log_path = str(tmp_path / "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([cli("pagedllm"), "serve", model, "--port", str(port), "--device", "cpu",
                                 "--served-model-name", "tiny", "--data-parallel-size", "2", "--enforce-eager",
                                 "--kv-cache-memory-bytes", str(16 << 20), *flags],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}", port, log_path


def test_two_api_processes_over_two_data_parallel_engine_cores(tiny_llama_dir: str, e2e_env: dict,
                                                                tmp_path) -> None:
    """Each API process sends to both engine cores and each core answers both processes: every request's text
    equals the offline engine's, both cores and both processes took some, and the sums match."""
    from pagedllm import LLM, SamplingParams

    prompts = [f"The quick brown fox {i} jumps" + " again" * (i % 4) for i in range(32)]
    proc, url, port, log_path = _serve_two_cores(tiny_llama_dir, e2e_env, tmp_path, "--api-server-count", "2")
    try:
        wait_healthy(proc, url, timeout_s=240, log_path=log_path)
        wait_all_serving(Server(url, port, tiny_llama_dir, proc, log_path, api_servers=2))

        async def run_all() -> list[str]:  # 32 at once: 32 connections
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
                outs = await asyncio.gather(*(c.completions.create(model="tiny", prompt=p, max_tokens=8,
                                                                   temperature=0) for p in prompts))
            return [o.choices[0].text for o in outs]

        texts = asyncio.run(run_all())
        llm = LLM(tiny_llama_dir, device="cpu", enforce_eager=True)
        expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0),
                                                              use_tqdm=False)]
        llm.shutdown()
        assert texts == expected
        text = httpx.get(url + "/metrics", timeout=30).text
        per_core = [metric(text, "vllm:generation_tokens_total", engine=str(i)) for i in (0, 1)]
        assert min(per_core) > 0 and sum(per_core) == 32 * 8, per_core
        per_process = [metric(text, "pagedllm:api_server_requests_total", api_server=str(i)) for i in (0, 1)]
        assert min(per_process) > 0 and sum(per_process) == 32, per_process
        names = _process_names(proc.pid)
        assert {"pagedllm-api-0", "pagedllm-api-1", "pagedllm-core-0", "pagedllm-core-1"} <= set(names), names
    finally:
        stop(proc)


def test_the_data_parallel_rank_header_pins_a_request_to_its_engine_core(tiny_llama_dir: str, e2e_env: dict,
                                                                           tmp_path) -> None:
    """vLLM's `X-data-parallel-rank: R` header sends a request to engine core R (an external router's choice);
    it was ignored (the server's own balancing chose). Chat, completions (streamed or not, n > 1, beam search),
    responses and embeddings all take it; a rank outside [0, data-parallel-size) or not an integer is a 400 naming
    the header."""
    proc, url, _, log_path = _serve_two_cores(tiny_llama_dir, e2e_env, tmp_path)
    try:
        wait_healthy(proc, url, timeout_s=240, log_path=log_path)
        with httpx.Client(base_url=url, timeout=120) as http:
            def per_core(name: str) -> list[float]:
                text = http.get("/metrics").text
                return [metric(text, name, engine=str(i)) for i in (0, 1)]

            for rank in (1, 0):
                before = per_core("vllm:e2e_request_latency_seconds_count")
                pin = {"X-data-parallel-rank": str(rank)}
                bodies = [("/v1/completions", {"model": "tiny", "prompt": "a b c", "max_tokens": 3, "n": 2}),
                          ("/v1/completions", {"model": "tiny", "prompt": "d e", "max_tokens": 3, "stream": True}),
                          ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 3}),
                          ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 3}),
                          ("/v1/embeddings", {"model": "tiny", "input": ["x y", "z"]}),
                          ("/v1/completions", {"model": "tiny", "prompt": "f g", "max_tokens": 2, "n": 2,
                                               "use_beam_search": True})]
                for path, body in bodies * 2:  # twice: the balancer alone would spread them over both cores
                    r = http.post(path, json=body, headers=pin)
                    assert r.status_code == 200, (path, r.text)
                after = per_core("vllm:e2e_request_latency_seconds_count")
                # beam search: an engine request per beam and step; the rest: completions n=2 (2) + stream (1) +
                # chat (1) + responses (1) + embeddings (2), twice
                assert after[rank] - before[rank] > 14 and after[1 - rank] == before[1 - rank], (rank, before, after)
            for bad in ("2", "-1", "one"):
                r = http.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 1},
                              headers={"X-data-parallel-rank": bad})
                assert r.status_code == 400, (bad, r.text)
                assert "X-data-parallel-rank" in r.json()["error"]["message"], r.text
    finally:
        stop(proc)
