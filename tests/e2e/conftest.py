"""End-to-end fixtures: one real `pagedllm serve` (SmolLM2-135M on the CPU) on a free port for the session.

The server is started the way a user would start it (`pagedllm serve MODEL --config FILE.yaml --port P`),
with settings in a YAML file so `--config` is exercised by every test, and an API key so auth is too.
Constants and helpers live in e2e_helpers.py (importing from a conftest module is fragile).
"""
from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from e2e_helpers import API_KEY, MAX_MODEL_LEN, SERVED_NAME, Server, api_server_counts, cli, stop, wait_all_serving

from pagedllm.entrypoints.server_process import free_port, wait_healthy


@pytest.fixture(scope="session")
def e2e_env(smollm2_cache_dir: str) -> dict:
    env = dict(os.environ)
    env["PAGEDLLM_CACHE_DIR"] = smollm2_cache_dir  # the default model converts once, into the test cache
    env["PAGEDLLM_DISABLE_PROGRESS_BARS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test of the shared server runs with `server` parametrized by its --api-server-count (1, and 2 for
    the modules of TWO_API_SERVER_MODULES): tests of one count run together, one server at a time."""
    if "server" in metafunc.fixturenames:
        counts = api_server_counts(str(metafunc.definition.path))
        metafunc.parametrize("server", counts, indirect=True, ids=[f"api{n}" for n in counts])


@pytest.fixture(scope="session")
def server(request: pytest.FixtureRequest, smollm2_hf_dir: str, e2e_env: dict,
           tmp_path_factory: pytest.TempPathFactory) -> Server:
    api_servers = getattr(request, "param", 1)
    tmp = tmp_path_factory.mktemp(f"server-api{api_servers}")
    config = tmp / "serve.yaml"
    # port 1 in the file: the command line's --port must win
    config.write_text(f"api-key: {API_KEY}\nserved-model-name: [{SERVED_NAME}, smol-alias]\n"
                      f"max-model-len: {MAX_MODEL_LEN}\nkv-cache-memory-bytes: {256 << 20}\nport: 1\nseed: 0\nmax-num-seqs: 64\n")
    port = free_port()
    log_path = str(tmp / "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([cli("pagedllm"), "serve", smollm2_hf_dir, "--config", str(config), "--port", str(port),
                                 "--api-server-count", str(api_servers)],
                                stdout=log, stderr=subprocess.STDOUT, env=e2e_env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path=log_path)
        server = Server(url, port, smollm2_hf_dir, proc, log_path, api_servers)
        wait_all_serving(server)
        yield server
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def offline_llm(smollm2_hf_dir: str):
    """The offline engine on the server's model and settings: the reference the server's outputs must equal."""
    from pagedllm import LLM

    llm = LLM(model=smollm2_hf_dir, max_model_len=MAX_MODEL_LEN, seed=0, kv_cache_memory_bytes=64 << 20)
    try:
        yield llm
    finally:
        llm.engine.shutdown()


@pytest.fixture()
def http(server: Server) -> httpx.Client:
    with server.client() as c:
        yield c


