"""Mixture-of-experts models through the real engine on the CPU (paged KV cache, continuous batching): greedy
tokens and their logprobs equal transformers' in mixed batches, chunked prefill (where a token's experts are
picked in a different step from its neighbours'), prefix-cache hits and preemption."""
from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.layers.fused_moe import FusedMoE
from tests.engine.test_correctness import check_against_hf, random_prompts
from tests.models.moe_helpers import MOE_ARCHS, tiny_moe_dir  # noqa: F401 - the fixture


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_mixed_batch_matches_hf(arch, tiny_moe_dir):
    model_dir = tiny_moe_dir(arch)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64)
    experts = [m for m in llm.engine.worker.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all("cpu_packed_experts" in m.__dict__ for m in experts)  # the prepacked CPU path runs
    prompts = random_prompts([1, 5, 17, 33, 64, 3], seed=11)
    check_against_hf(llm, model_dir, prompts, [12, 7, 20, 9, 15, 24])


def test_chunked_prefill_matches_hf(tiny_moe_dir):
    model_dir = tiny_moe_dir("qwen3_moe")
    llm = LLM(model=model_dir, dtype="float32", max_num_batched_tokens=8, max_num_seqs=4, num_gpu_blocks_override=64)
    prompts = random_prompts([40, 3, 27, 9, 50], seed=12)
    check_against_hf(llm, model_dir, prompts, [10, 14, 6, 12, 8])


def test_prefix_cache_hits_match_hf(tiny_moe_dir):
    model_dir = tiny_moe_dir("mixtral")
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64, block_size=8)
    shared = random_prompts([37], seed=13)[0]
    prompts = random_prompts([0, 4, 11, 1], seed=14, prefix=shared)
    check_against_hf(llm, model_dir, prompts[:1], [6])
    before = llm.engine.get_stats().prefix_cache_hits
    outs = check_against_hf(llm, model_dir, prompts, [9, 5, 13, 7])
    assert [o.num_cached_tokens >= 32 for o in outs] == [True] * 4, [o.num_cached_tokens for o in outs]
    assert llm.engine.get_stats().prefix_cache_hits - before == sum(o.num_cached_tokens for o in outs)


def test_preemption_matches_hf(tiny_moe_dir):
    model_dir = tiny_moe_dir("qwen2_moe")
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=10, block_size=8, max_model_len=80,
              enable_prefix_caching=False)
    prompts = random_prompts([12, 20, 7, 15], seed=15)
    check_against_hf(llm, model_dir, prompts, [24, 18, 30, 20])
    assert llm.engine.get_stats().num_preemptions > 0
