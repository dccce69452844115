"""Sliding-window models through the engine on CUDA (Triton kernels, decode and mixed-step CUDA graphs, the fused
qkv path, FP8 KV): tokens and logprobs equal transformers' in fp32 past the window, and the pool stays bounded."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_correctness import check_against_hf, random_prompts
from tests.engine.test_sliding_window import (  # noqa: F401  (fixtures)
    BS,
    MIXED_WINDOW,
    WINDOW,
    PoolWatch,
    mistral_dir,
    mixed_dir,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("which", ["mistral", "mixed"])
def test_fp32_windowed_models_match_hf_with_cuda_graphs(which, mistral_dir, mixed_dir):  # noqa: F811
    model_dir = mistral_dir if which == "mistral" else mixed_dir
    llm = LLM(model=model_dir, dtype="float32", device="cuda", block_size=BS, num_gpu_blocks_override=256,
              max_num_seqs=16)
    runner = llm.engine.worker.runner
    assert runner.cuda_graphs is not None and runner.mixed_graphs is not None
    prompts = random_prompts([3, 20, 70, 130, 200, 33], seed=31)
    check_against_hf(llm, model_dir, prompts, [60, 25, 20, 12, 8, 30])
    assert runner.mixed_graphs.num_replays > 0


@pytest.mark.parametrize("which", ["mistral", "mixed"])
def test_chunked_prefill_prefix_hits_and_preemption_on_gpu(which, mistral_dir, mixed_dir):  # noqa: F811
    model_dir = mistral_dir if which == "mistral" else mixed_dir
    llm = LLM(model=model_dir, dtype="float32", device="cuda", block_size=BS, max_num_batched_tokens=16,
              max_num_seqs=4, num_gpu_blocks_override=24 if which == "mistral" else 48, max_model_len=224)
    shared = random_prompts([70], seed=32)[0]
    prompts = random_prompts([5, 9, 2, 14], seed=33, prefix=shared)
    check_against_hf(llm, model_dir, prompts, [30, 35, 26, 32])
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0
    if stats.num_preemptions == 0:
        # The shared prefix's blocks and the window's freeing can make the four fit (they did on the H200 for
        # Mistral): preempt with prompts that share nothing, as tests/engine/test_sliding_window.py does.
        llm.shutdown()
        llm = LLM(model=model_dir, dtype="float32", device="cuda", block_size=BS, max_num_batched_tokens=16,
                  max_num_seqs=4, num_gpu_blocks_override=20 if which == "mistral" else 40, max_model_len=224)
        lens, seed, out = ([100, 101, 102, 103], 18, 20) if which == "mistral" else ([40, 41, 42, 43], 24, 12)
        check_against_hf(llm, model_dir, random_prompts(lens, seed=seed), [out] * 4)
        assert llm.engine.get_stats().num_preemptions > 0


def test_long_sequence_uses_bounded_blocks_on_gpu(mistral_dir):  # noqa: F811
    llm = LLM(model=mistral_dir, dtype="float32", device="cuda", block_size=BS, num_gpu_blocks_override=16,
              max_model_len=512, max_num_batched_tokens=32, max_num_seqs=4)
    watch = PoolWatch(llm)
    check_against_hf(llm, mistral_dir, random_prompts([40], seed=34), [400])
    assert max(watch.used[1:]) <= WINDOW // BS + 2


def test_speculative_verify_steps_keep_the_window(mistral_dir):  # noqa: F811
    base = random_prompts([24], seed=35)[0]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llm = LLM(model=mistral_dir, dtype="float32", device="cuda", block_size=BS, num_gpu_blocks_override=64,
              speculative_config=spec)
    check_against_hf(llm, mistral_dir, [base * 4, random_prompts([90], seed=36)[0]], [40, 30])
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("which", ["mistral", "mixed"])
def test_bf16_cuda_graphs_equal_eager(which, mistral_dir, mixed_dir):  # noqa: F811
    model_dir = mistral_dir if which == "mistral" else mixed_dir
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 130, 11, 50, 7, 1, 90, 2, 44], seed=37)]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kw = dict(model=model_dir, dtype="bfloat16", device="cuda", block_size=BS, num_gpu_blocks_override=256)
    graph = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, sp, use_tqdm=False)]
    eager = [o.outputs[0].token_ids for o in LLM(**kw, enforce_eager=True).generate(prompts, sp, use_tqdm=False)]
    assert graph == eager


def test_fp8_cache_keeps_the_window_on_gpu(mistral_dir):  # noqa: F811
    """The first token's top logprobs with an FP8 cache: within E4M3 rounding of transformers' windowed ones."""
    from transformers import AutoConfig, AutoModelForCausalLM

    prompt = random_prompts([130], seed=38)[0]
    llm = LLM(model=mistral_dir, dtype="bfloat16", device="cuda", block_size=BS, num_gpu_blocks_override=64,
              kv_cache_dtype="fp8")
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0].outputs[0].logprobs[0]
    tokens = sorted(out)
    got = torch.tensor([out[t].logprob for t in tokens])
    config = AutoConfig.from_pretrained(mistral_dir)
    errors = []
    for window in (WINDOW, None):
        config.sliding_window = window
        model = AutoModelForCausalLM.from_pretrained(mistral_dir, config=config, dtype=torch.float32).eval()
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([prompt]), use_cache=False).logits[0, -1], -1)
        errors.append((got - lp[tokens]).abs().max().item())
    assert errors[0] < 0.1 and errors[1] > 3 * errors[0], errors


def test_mixed_groups_bound_only_sliding_layers_on_gpu(mixed_dir):  # noqa: F811
    llm = LLM(model=mixed_dir, dtype="float32", device="cuda", block_size=BS, num_gpu_blocks_override=200,
              max_model_len=512)
    watch = PoolWatch(llm)
    check_against_hf(llm, mixed_dir, random_prompts([20], seed=39), [200])
    first_sliding, second_sliding, full = zip(*watch.held[1:])
    assert max(first_sliding) <= MIXED_WINDOW // BS + 2 and max(second_sliding) <= MIXED_WINDOW // BS + 2
    assert max(full) == -(-(20 + 199) // BS)
