"""Fixtures of the deployment / robustness tests: the tiny random Llama (fast on 2 CPU cores, 512-token
context) served by real `pagedllm serve` processes on loopback ports."""
from __future__ import annotations

import os

import pytest

from robust_helpers import API_KEY, MAX_BODY, SEND_TIMEOUT


@pytest.fixture(scope="session")
def robust_env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    env = dict(os.environ)
    env["PAGEDLLM_CACHE_DIR"] = str(tmp_path_factory.mktemp("pagedllm-cache"))
    env["PAGEDLLM_DISABLE_PROGRESS_BARS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # The tiny model gains nothing from intra-op threads, and spinning OpenMP threads of several servers
    # on 2 shared cores slow every step down.
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PAGEDLLM_API_KEY", None)
    env.pop("VLLM_API_KEY", None)  # (vLLM's name of it)
    return env


# Modules whose tests of the shared server also run against 2 API server processes (`--api-server-count 2`): load,
# hostile HTTP and fields, auth: every module of that server.
# PAGEDLLM_TEST_API_SERVERS=N runs every server of the suite with N (robust_helpers.launch).
TWO_API_SERVER_MODULES = ("test_load.py", "test_hostile_http.py", "test_hostile_fields.py", "test_auth.py")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "tiny_server" in metafunc.fixturenames:
        forced = os.environ.get("PAGEDLLM_TEST_API_SERVERS")
        counts = [int(forced)] if forced else (
            [1, 2] if metafunc.definition.path.name in TWO_API_SERVER_MODULES else [1])
        metafunc.parametrize("tiny_server", counts, indirect=True, ids=[f"api{n}" for n in counts])


@pytest.fixture(scope="session")
def tiny_server(request: pytest.FixtureRequest, tiny_llama_dir: str, robust_env: dict,
                tmp_path_factory: pytest.TempPathFactory):
    """One server for the load, hostile-input, auth and fuzzing tests (with an API key), per --api-server-count."""
    from robust_helpers import launch, stop

    api_servers = getattr(request, "param", 1)
    log_path = str(tmp_path_factory.mktemp(f"tiny-server-api{api_servers}") / "server.log")
    server = launch(tiny_llama_dir, ["--api-key", API_KEY, "--max-num-seqs", "256", "--send-timeout", str(SEND_TIMEOUT),
                                     "--max-request-body-bytes", str(MAX_BODY),
                                     "--kv-cache-memory-bytes", str(256 << 20), "--disable-uvicorn-access-log",
                                     "--api-server-count", str(api_servers)],
                    robust_env, log_path)
    server.extra["headers"] = {"Authorization": f"Bearer {API_KEY}"}
    try:
        yield server
    finally:
        stop(server.proc)
