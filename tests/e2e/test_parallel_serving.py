"""Data parallelism behind one real server: `pagedllm serve --data-parallel-size 2` (each engine core driving
one worker process through the multi-process executor) answers 32 concurrent requests from the real openai
client with both cores, the same text as one engine core, /metrics per core (`engine` label); then one core's
worker is killed: /health turns 503 naming the core and the rank, and the server exits non-zero. The engine cores
and workers have pagedllm's OpenMP wait policy in their environment, and every OpenMP runtime in the process tree
reports it (libgomp's OMP_DISPLAY_ENV=VERBOSE report: spin count envs.OWN_SPIN_COUNT)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from e2e_helpers import cli, metric, stop

from pagedllm.entrypoints.server_process import free_port, wait_healthy
from pagedllm.envs import OWN_SPIN_COUNT

pytestmark = pytest.mark.timeout(300)

PROMPTS = [f"The quick brown fox {i} jumps over the lazy dog" + " again" * (i % 5) for i in range(32)]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


async def _complete_all(base_url: str) -> list[str]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    outs = await asyncio.gather(*[client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
                                  for p in PROMPTS])
    await client.close()
    return [o.choices[0].text for o in outs]


def test_data_parallel_server(tiny_llama_dir, e2e_env, tmp_path):
    from pagedllm import LLM, SamplingParams

    # pagedllm's own OpenMP policy, not the one tests/conftest.py sets for the suite
    env = {k: v for k, v in e2e_env.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = str(tmp_path / "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([cli("pagedllm"), "serve", tiny_llama_dir, "--port", str(port), "--device", "cpu",
                                 "--served-model-name", "tiny", "--data-parallel-size", "2",
                                 "--distributed-executor-backend", "mp", "--enforce-eager",
                                 "--kv-cache-memory-bytes", str(16 << 20), "--engine-dead-grace-period", "2"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, url, timeout_s=240, log_path=log_path)
        texts = asyncio.run(_complete_all(url + "/v1"))
        llm = LLM(tiny_llama_dir, device="cpu", enforce_eager=True)
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0),
                                                              use_tqdm=False)]
        assert texts == expected
        text = httpx.get(url + "/metrics", timeout=10).text
        per_core = [metric(text, "vllm:generation_tokens_total", engine=str(i)) for i in (0, 1)]
        assert min(per_core) > 0 and sum(per_core) == 32 * 8, per_core  # both cores served
        assert metric(text, "vllm:request_success_total", engine="1", finished_reason="length") > 0

        cores = [p for p in _children(proc.pid) if _comm(p).startswith("pagedllm-core")]  # not API processes
        workers = [w for c in cores for w in _children(c) if "pagedllm.executor.worker_proc" in _cmdline(w)]
        assert len(cores) == 2 and len(workers) == 2
        for pid in cores + workers:  # pagedllm's own processes: its variables given at their start
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert f"GOMP_SPINCOUNT={OWN_SPIN_COUNT}".encode() in f.read().split(b"\0"), _cmdline(pid)
        with open(log_path) as f:
            spins = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", f.read())
        assert len(spins) >= 5 and set(spins) == {OWN_SPIN_COUNT}, spins  # the API process, 2 cores, 2 workers
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health", timeout=10).status_code == 200:
            assert time.monotonic() < deadline, "the server stayed healthy after a worker died"
            time.sleep(0.2)
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503
        assert re.search(rf"engine core [01] stopped: WorkerFailed: worker rank 0 \(pid {workers[0]}\) died",
                         health.json()["error"]["message"]), health.text
        assert proc.wait(60) == 1  # exits non-zero after the grace period instead of lingering
    finally:
        stop(proc)
