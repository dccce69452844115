"""A mixture-of-experts model on tensor- and pipeline-parallel engines (two gloo worker processes on the CPU) gives
one rank's tokens through the shared workload: mixed batches,
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


_reference: dict[str, dict] = {}


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_qwen3_moe_parallel_matches_one_rank(tiny_moe_dir, tp, pp):
    """tp2: every expert's intermediate dimension split; pp2: layers 0-1 (sparse, dense) and 2 (sparse) on two
    stages."""
    model_dir = tiny_moe_dir("qwen3_moe")
    if model_dir not in _reference:
        _reference[model_dir] = _run(model_dir)
    expected = _reference[model_dir]
    assert expected["preempted"] and expected["prefix_hits"], "the workload must preempt and hit the cache"
    assert _run(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp) == expected
