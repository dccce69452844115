"""Fixtures of the deployment / robustness tests: the tiny random Llama (fast on 2 CPU cores, 512-token
context) served by real `pagedllm serve` processes on loopback ports."""
from __future__ import annotations

import os

import pytest


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
    return env
