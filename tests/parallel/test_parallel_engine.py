"""Tensor, pipeline and tensor x pipeline parallel engines (gloo worker processes on the CPU) give the same
tokens as one in-process rank: greedy and seeded sampling, through mixed batches, prefill chunks, prefix-cache
hits and preemptions (tests/parallel/workload.py). Every multi-process engine is bounded by a timeout."""
from __future__ import annotations

import pytest

from pagedllm import LLM
from tests.parallel.workload import ENGINE_KWARGS, run_workload

pytestmark = pytest.mark.timeout(240)

_reference: dict[str, dict] = {}


def _run(model_dir: str, **kwargs) -> dict:
    llm = LLM(model_dir, **ENGINE_KWARGS, **kwargs)
    try:
        return run_workload(llm)
    finally:
        llm.engine.shutdown()


def _expected(model_dir: str) -> dict:
    if model_dir not in _reference:
        _reference[model_dir] = _run(model_dir)
    return _reference[model_dir]


# gemma2-pp2: the scaled embedding on the first stage, the tied LM head and the final soft-cap on the last, Gemma's
# four norms per layer with the residual carried between stages, soft-capped attention
@pytest.mark.parametrize("arch,tp,pp", [("llama", 2, 1), ("qwen2", 1, 2), ("qwen2", 2, 2), ("gemma2", 1, 2)],
                         ids=["llama-tp2", "qwen2-pp2", "qwen2-tp2xpp2", "gemma2-pp2"])
def test_parallel_layout_matches_one_rank(tiny_model_dir, arch, tp, pp):
    model_dir = tiny_model_dir(arch)
    expected = _expected(model_dir)
    assert expected["preempted"] and expected["prefix_hits"], "the workload must preempt and hit the cache"
    got = _run(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert got == expected


@pytest.fixture(scope="module")
def sliding_qwen2_dir(tmp_path_factory):
    """Layer 0 full attention, layer 1 a 12-token window: two KV-cache groups, one per pipeline stage at pp=2."""
    from tests.models.swa_helpers import save_swa_model
    return save_swa_model(str(tmp_path_factory.mktemp("qwen2-swa")), "qwen2", use_sliding_window=True,
                          sliding_window=12, max_window_layers=1)


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)], ids=["pp2", "tp2xpp2"])
def test_sliding_window_groups_across_stages_match_one_rank(sliding_qwen2_dir, tp, pp):
    expected = _expected(sliding_qwen2_dir)
    assert expected["preempted"] and expected["prefix_hits"]
    assert _run(sliding_qwen2_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp) == expected


def test_smollm2_tp3_and_pp2_match_one_rank(smollm2_hf_dir):
    """The real model: 9 heads / 3 KV heads / 30 layers -> TP=3, and PP=2 with 15 layers per stage."""
    from pagedllm import SamplingParams

    prompts = ["The capital of Germany is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=8)

    def tokens(**kwargs) -> list[list[int]]:
        llm = LLM(smollm2_hf_dir, device="cpu", dtype="float32", enforce_eager=True, max_model_len=256,
                  kv_cache_memory_bytes=64 << 20, **kwargs)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()

    expected = tokens()
    assert tokens(tensor_parallel_size=3) == expected
    assert tokens(pipeline_parallel_size=2) == expected


def test_smollm2_gguf_packed_weights_pp2_match_one_rank(smollm2_gguf_path):
    """The .gguf itself (its weights kept packed): the last stage's tied LM head packs the embedding's tensor as the
    first stage's embedding does (it failed to load before: one stage holds only a placeholder of each)."""
    from pagedllm import SamplingParams

    prompts = ["The capital of Germany is", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=8)

    def tokens(**kwargs) -> list[list[int]]:
        llm = LLM(smollm2_gguf_path, device="cpu", dtype="float32", max_model_len=256,
                  kv_cache_memory_bytes=64 << 20, **kwargs)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()

    assert tokens(pipeline_parallel_size=2) == tokens()
