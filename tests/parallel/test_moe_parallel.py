"""A mixture-of-experts model on a tensor-parallel engine (two gloo worker processes on the CPU: each holds every
expert's half of the intermediate dimension) gives one rank's tokens through the shared workload: mixed batches,
prefill chunks, preemptions, prefix-cache hits and seeded sampling (tests/parallel/workload.py)."""
from __future__ import annotations

import pytest

from pagedllm import LLM
from tests.models.moe_helpers import tiny_moe_dir  # noqa: F401 - the fixture
from tests.parallel.workload import ENGINE_KWARGS, run_workload

pytestmark = pytest.mark.timeout(240)


def _run(model_dir: str, **kwargs) -> dict:
    llm = LLM(model_dir, **ENGINE_KWARGS, **kwargs)
    try:
        return run_workload(llm)
    finally:
        llm.engine.shutdown()


def test_qwen3_moe_tp2_matches_one_rank(tiny_moe_dir):
    model_dir = tiny_moe_dir("qwen3_moe")
    expected = _run(model_dir)
    assert expected["preempted"] and expected["prefix_hits"], "the workload must preempt and hit the cache"
    assert _run(model_dir, tensor_parallel_size=2) == expected
