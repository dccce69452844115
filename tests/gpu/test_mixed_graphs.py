"""Mixed prefill + decode steps replayed as CUDA graphs: the same tokens as eager steps and as transformers."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_correctness import check_against_hf, random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _tokens(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp32_mixed_graphs_match_hf(arch, tiny_model_dir):
    """Chunked prefill (a 48-token budget), prefix hits and preemption, every mixed step through the graphs."""
    model_dir = tiny_model_dir(arch)
    llm = LLM(model=model_dir, dtype="float32", device="cuda", num_gpu_blocks_override=12, block_size=16,
              max_model_len=192, max_num_batched_tokens=48, max_num_seqs=6)
    mixed = llm.engine.worker.runner.mixed_graphs
    assert mixed is not None and mixed.sizes[-1] == 48
    shared = random_prompts([20], seed=3)[0]
    prompts = random_prompts([5, 40, 2, 14, 70, 9], seed=4, prefix=shared)
    check_against_hf(llm, model_dir, prompts, [30, 12, 26, 20, 8, 33])
    assert mixed.num_replays > 0
    assert llm.engine.get_stats().num_preemptions > 0


def test_changing_batches_equal_eager(tiny_qwen3_dir):
    """Random arrivals and finishes: every step has another composition, so stale metadata would show."""
    rng = random.Random(0)
    lengths = [rng.randint(1, 90) for _ in range(40)]
    prompts = random_prompts(lengths, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    kwargs = dict(model=tiny_qwen3_dir, dtype="float32", device="cuda", num_gpu_blocks_override=256,
                  max_num_batched_tokens=256, max_num_seqs=16)
    graphs = LLM(**kwargs)
    eager = LLM(**kwargs, enforce_eager=True)
    assert _tokens(graphs, prompts, params) == _tokens(eager, prompts, params)
    assert graphs.engine.worker.runner.mixed_graphs.num_replays > 0


def test_bf16_mixed_graph_logprobs_close_to_eager(tiny_llama_dir):
    prompts = random_prompts([3, 30, 11, 50, 7, 1, 19, 2, 44], seed=9)
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    kwargs = dict(model=tiny_llama_dir, dtype="bfloat16", device="cuda", num_gpu_blocks_override=128)
    a = LLM(**kwargs).generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    b = LLM(**kwargs, enforce_eager=True).generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for x, y in zip(a, b):
        lx, ly = x.outputs[0].logprobs[0], y.outputs[0].logprobs[0]
        shared = set(lx) & set(ly)
        assert shared
        for t in shared:
            assert abs(lx[t].logprob - ly[t].logprob) < 0.05


def test_enforce_eager_and_env_turn_mixed_graphs_off(tiny_llama_dir, monkeypatch):
    assert LLM(model=tiny_llama_dir, device="cuda", enforce_eager=True,
               num_gpu_blocks_override=32).engine.worker.runner.mixed_graphs is None
    monkeypatch.setenv("PAGEDLLM_MIXED_GRAPH_MAX_TOKENS", "0")
    llm = LLM(model=tiny_llama_dir, device="cuda", num_gpu_blocks_override=32)
    assert llm.engine.worker.runner.mixed_graphs.sizes == []


def test_buckets_capped_by_what_a_step_can_hold(tiny_llama_dir):
    """A step never holds more than max_num_seqs full-length requests: no bucket beyond that (capture used to fail
    filling inputs for a bucket it could not cover with max_num_seqs requests of max_model_len tokens)."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cuda", max_num_seqs=4, max_model_len=100,
              max_num_batched_tokens=2048)
    mixed = llm.engine.worker.runner.mixed_graphs
    assert mixed.sizes[-1] == 400
    prompts = random_prompts([90, 95, 80, 99, 3], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    eager = LLM(model=tiny_llama_dir, dtype="float32", device="cuda", max_num_seqs=4, max_model_len=100,
                max_num_batched_tokens=2048, enforce_eager=True)
    assert _tokens(llm, prompts, params) == _tokens(eager, prompts, params)
    assert mixed.num_replays > 0


def test_compilation_config_chooses_the_graphs(tiny_qwen3_dir):
    """vLLM's compilation_config: capture sizes (decode requests up to max_num_seqs, mixed-step tokens from 2),
    FULL_DECODE_ONLY (no mixed graphs) and level 0 (none); the tokens stay the eager ones."""
    prompts = random_prompts([3, 30, 11, 50, 7], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = dict(model=tiny_qwen3_dir, dtype="float32", device="cuda", num_gpu_blocks_override=128,
                  max_num_batched_tokens=64, max_num_seqs=8)
    sized = LLM(**kwargs, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 32]})
    runner = sized.engine.worker.runner
    assert runner.cuda_graphs.sizes == [1, 2, 4] and runner.mixed_graphs.sizes == [2, 4, 32]
    decode_only = LLM(**kwargs, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})
    assert decode_only.engine.worker.runner.cuda_graphs is not None
    assert decode_only.engine.worker.runner.mixed_graphs is None
    eager = LLM(**kwargs, compilation_config=0)
    assert eager.engine.worker.runner.enforce_eager and eager.engine.worker.runner.cuda_graphs is None
    expected = _tokens(eager, prompts, params)
    assert _tokens(sized, prompts, params) == expected == _tokens(decode_only, prompts, params)
    assert runner.mixed_graphs.num_replays > 0
