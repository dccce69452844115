"""Parallel start-up errors are one sentence; a worker rank that dies or hangs stops the engine with an error
naming the rank (no hang: every test is bounded by a timeout below the engine's default ones)."""
from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.engine_core import EngineCoreRequest
from pagedllm.executor.multiproc import WorkerFailed
from pagedllm.executor.parallel_config import ParallelLayout, check_layout

# The hang guard of every test: below the 300 s defaults of PAGEDLLM_DIST_TIMEOUT_S and
# PAGEDLLM_NODE_JOIN_TIMEOUT_S, so a test whose short setting is not honoured fails here instead of passing late.
pytestmark = pytest.mark.timeout(180)

_TINY = dict(device="cpu", enforce_eager=True, max_num_seqs=4, num_gpu_blocks_override=64)


def test_layout_errors_are_one_sentence(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(tiny_llama_dir, tensor_parallel_size=3, **_TINY)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 is larger than the model's 2 layers"):
        LLM(tiny_llama_dir, pipeline_parallel_size=3, **_TINY)
    with pytest.raises(ValueError, match="data_parallel_size > 1 runs several engine cores"):
        LLM(tiny_llama_dir, data_parallel_size=2, **_TINY)
    cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, intermediate_size=64, num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"^4 ranks per node .* need 4 GPUs but this node has 2\.$"):
        check_layout(ParallelLayout(2, 2), cfg, "cuda", 2)
    with pytest.raises(ValueError, match="KV heads do not divide one another"):
        check_layout(ParallelLayout(3, 1), SimpleNamespace(num_attention_heads=6, num_key_value_heads=4,
                                                           intermediate_size=60, num_hidden_layers=4), "cpu", 0)
    check_layout(ParallelLayout(4, 2, nnodes=2), cfg, "cuda", 4)  # 8 ranks over 2 nodes of 4 GPUs: fine


def _master_port() -> int:
    """A port free with the next one (the head binds master_port + 1 for its plan socket): a free port alone
    could have its neighbour taken by another test's socket (the head then failed with 'Address already in use')."""
    import socket

    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("", 0))  # (all interfaces: the head binds tcp://*)
            port = a.getsockname()[1]
            try:
                b.bind(("", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports found")


def test_node_that_never_joins_fails_start(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_NODE_JOIN_TIMEOUT_S", "8")
    with pytest.raises(RuntimeError, match=r"node\(s\) \[1\] never joined within 8 s: start `pagedllm serve`"):
        LLM(tiny_llama_dir, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=_master_port(),
            **_TINY)


def _engine_with_running_request(model_dir: str, **kwargs) -> LLM:
    llm = LLM(model_dir, tensor_parallel_size=2, **_TINY, **kwargs)
    llm.engine.add_request(EngineCoreRequest("long", [5, 6, 7, 8],
                                             SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)))
    for _ in range(3):
        llm.engine.step()
    return llm


def _step_until_failure(llm: LLM) -> str:
    with pytest.raises(WorkerFailed) as info:
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    # Stays failed: the next call says the same instead of hanging.
    with pytest.raises(WorkerFailed):
        llm.engine.step()
    return str(info.value)


def test_killed_worker_stops_the_engine_naming_the_rank(tiny_llama_dir):
    llm = _engine_with_running_request(tiny_llama_dir)
    victim = llm.engine.worker.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    # Dead before the next step (a loaded machine may take a while to end it): the engine must name it, not
    # merely report rank 0's broken connection to it.
    victim.wait(60)  # a hang guard
    message = _step_until_failure(llm)
    assert f"worker rank 1 (pid {victim.pid}) died with exit code -9" in message
    assert all(p.poll() is not None for p in llm.engine.worker.procs.values())  # no orphaned rank
    llm.engine.shutdown()


def test_hung_worker_times_out_instead_of_hanging(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_DIST_TIMEOUT_S", "6")
    llm = _engine_with_running_request(tiny_llama_dir)
    victim = llm.engine.worker.procs[1]
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        message = _step_until_failure(llm)
        assert "worker rank 0 failed" in message and "rank(s) [1] did not answer (dead or hung)" in message
    finally:
        if victim.poll() is None:
            os.kill(victim.pid, signal.SIGKILL)
        llm.engine.shutdown()


@pytest.mark.parametrize("kwargs", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                    dict(distributed_executor_backend="mp"), dict(nnodes=2)])
def test_spec_decode_with_worker_processes_is_refused(kwargs):
    from pagedllm.config import EngineArgs

    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    with pytest.raises(ValueError, match=r"--speculative-config with worker processes .* is not supported yet"):
        EngineArgs(model="m", speculative_config=spec, **kwargs).validate()
    EngineArgs(model="m", enable_lora=True, **kwargs).validate()  # LoRA runs on worker ranks (test_parallel_lora)
    EngineArgs(model="m", speculative_config=spec).validate()  # one in-process rank: built


def test_head_plan_port_taken_is_one_sentence(tiny_llama_dir):
    """The head listens on --master-port + 1 for its plan socket: that port taken is an error naming it and what to
    do (it was zmq's bare 'Address already in use')."""
    import socket

    port = _master_port()
    with socket.socket() as holder:
        holder.bind(("", port + 1))
        holder.listen()
        with pytest.raises(RuntimeError, match=rf"plan socket cannot listen on port {port + 1} \(--master-port "
                                               rf"{port} \+ 1\): .*Choose a --master-port whose next port is free"):
            LLM(tiny_llama_dir, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port, **_TINY)


def test_a_killed_engine_leaves_no_worker_directory(tiny_llama_dir):
    """SIGKILL to the process that holds a tensor-parallel engine: its ranks exit (their parent watchdog) and remove
    the directory of their spec files and plan socket that it made and could not remove (it stayed in /tmp)."""
    import subprocess
    import sys
    import time

    import pathlib
    import tempfile

    import psutil

    holder = tempfile.TemporaryDirectory(prefix="pgw-")  # short: a socket path holds at most 107 bytes
    tmp = pathlib.Path(holder.name)
    script = (f"from pagedllm import LLM\nllm = LLM({tiny_llama_dir!r}, tensor_parallel_size=2, **{_TINY!r})\n"
              "print('ready', flush=True)\nimport time\ntime.sleep(600)\n")
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 2 and [p.name for p in tmp.iterdir() if p.name.startswith("pagedllm-workers-")]
        proc.kill()
        proc.wait(60)
        gone, alive = psutil.wait_procs(ranks, timeout=60)  # a hang guard
        assert not alive
        deadline = time.monotonic() + 30  # (each rank removes it before it exits; a little slack for the file system)
        while [p.name for p in tmp.iterdir() if p.name.startswith("pagedllm-workers-")]:
            assert time.monotonic() < deadline, sorted(p.name for p in tmp.iterdir())
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)
        holder.cleanup()


def test_a_temp_directory_too_long_for_sockets_is_not_used_for_them(tiny_llama_dir, tmp_path, monkeypatch):
    """A deep TMPDIR (a cluster job's) is too long for a Unix socket path (107 bytes): the ranks' plan socket goes in
    /tmp instead (it failed with zmq's 'ipc path ... is longer than 107 characters')."""
    import tempfile

    from pagedllm.process_utils import socket_directory

    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    directory = socket_directory("pagedllm-test-")
    try:
        assert os.path.dirname(directory) == "/tmp" and os.path.basename(directory).startswith("pagedllm-test-")
    finally:
        os.rmdir(directory)
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **_TINY)
    try:
        assert llm.engine.worker._tmpdir.startswith("/tmp/pagedllm-workers-")
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0,
                                                                           ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.engine.shutdown()
    with tempfile.TemporaryDirectory(prefix="pgs-", dir="/tmp") as short_tmp:  # a short one is used as is
        monkeypatch.setattr(tempfile, "tempdir", short_tmp)
        assert os.path.dirname(socket_directory("pagedllm-test-")) == short_tmp
