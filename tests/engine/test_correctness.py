"""Engine-level correctness against Hugging Face transformers with the same weights.

Every scenario runs several requests of different lengths together through the real engine (paged KV cache,
continuous batching) and checks, for every request, that the greedy tokens equal transformers' greedy tokens
and that the logprob of every generated token matches transformers' log_softmax within fp32 tolerance.
"""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import BeamSearchParams
from tests.conftest import skip_without_onednn_bf16

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
_hf_cache: dict = {}


def _hf_model(model_dir: str):
    """The transformers model of a directory in float32, loaded once per test session."""
    from transformers import AutoModelForCausalLM

    model = _hf_cache.get(model_dir)
    if model is None:
        # Eager attention: transformers versions that run Gemma 2 on SDPA (5.17) silently drop its attention
        # soft-capping; eager computes every family as its paper does.
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        _hf_cache[model_dir] = model
    return model


def hf_greedy(model_dir: str, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers (full forward per step: the simplest reference)."""
    key = (model_dir, tuple(prompt), max_tokens)
    if key in _hf_cache:
        return _hf_cache[key]
    model = _hf_model(model_dir)
    ids = list(prompt)
    tokens, logprobs = [], []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            tok = int(torch.argmax(logits))
            tokens.append(tok)
            logprobs.append(float(lp[tok]))
            ids.append(tok)
    _hf_cache[key] = (tokens, logprobs)
    return tokens, logprobs


def random_prompts(lengths, seed=0, vocab=512, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def check_against_hf(llm: LLM, model_dir: str, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=1) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        ref_tokens, ref_lps = hf_greedy(model_dir, prompt, m)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        got_lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        torch.testing.assert_close(torch.tensor(got_lps), torch.tensor(ref_lps), atol=2e-4, rtol=0)
        assert got.finish_reason == "length"
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_hf(arch, tiny_model_dir):
    model_dir = tiny_model_dir(arch)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64)
    prompts = random_prompts([1, 5, 17, 33, 64, 3], seed=1)
    check_against_hf(llm, model_dir, prompts, [12, 7, 20, 9, 15, 24])


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_greedy_matches_hf(arch, tiny_model_dir):
    """Greedy without logprobs takes the CPU LM head's bf16-screened argmax: still HF's tokens exactly."""
    skip_without_onednn_bf16()
    model_dir = tiny_model_dir(arch)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64)
    model = llm.engine.worker.model
    assert "cpu_greedy_screen" in model.lm_head.__dict__
    shortcut_rows = []  # rows the runner's argmax shortcut answered (it returns None where it does not apply)
    real = model.greedy_token_ids

    def spy(hidden):
        out = real(hidden)
        shortcut_rows.append(0 if out is None else len(out))
        return out

    model.greedy_token_ids = spy
    prompts = random_prompts([1, 5, 17, 33, 64, 3], seed=21)
    max_tokens = [12, 7, 20, 9, 15, 24]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, m)[0]
    # the path under test is really taken: every sampled token of every step came from the shortcut
    assert sum(shortcut_rows) == sum(max_tokens) and 0 not in shortcut_rows


def test_chunked_prefill_matches_hf(tiny_llama_dir):
    # A budget of 8 tokens per step forces every prompt into chunks, interleaved with other requests' decodes.
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_batched_tokens=8, max_num_seqs=4,
              num_gpu_blocks_override=64)
    prompts = random_prompts([40, 3, 27, 9, 50], seed=2)
    check_against_hf(llm, tiny_llama_dir, prompts, [10, 14, 6, 12, 8])


def test_prefix_cache_hits_match_hf(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, dtype="float32", num_gpu_blocks_override=64, block_size=8)
    shared = random_prompts([37], seed=3)[0]
    prompts = random_prompts([0, 4, 11, 1], seed=4, prefix=shared)
    check_against_hf(llm, tiny_qwen2_dir, prompts[:1], [6])  # fills the cache
    before = llm.engine.get_stats().prefix_cache_hits
    outs = check_against_hf(llm, tiny_qwen2_dir, prompts, [9, 5, 13, 7])
    hits = llm.engine.get_stats().prefix_cache_hits - before
    # every request reuses the shared prefix's 4 full blocks (and reports it), not just one of them
    assert [o.num_cached_tokens >= 32 for o in outs] == [True] * 4, [o.num_cached_tokens for o in outs]
    assert hits == sum(o.num_cached_tokens for o in outs)


def test_cache_salt_isolates_prefix_hits(tiny_qwen2_dir):
    """vLLM's cache_salt: blocks computed under one salt serve only requests of that salt (unsalted requests share
    among themselves); the tokens stay transformers' either way."""
    llm = LLM(model=tiny_qwen2_dir, dtype="float32", num_gpu_blocks_override=64, block_size=8)
    prompt = random_prompts([37], seed=5)[0]
    expected = hf_greedy(tiny_qwen2_dir, prompt, 5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    def run(salt):
        item = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        out = llm.generate([item], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected, salt
        return out.num_cached_tokens

    assert run("tenant-a") == 0
    assert run("tenant-b") == 0  # another salt: nothing of tenant-a's blocks
    assert run(None) == 0  # unsalted: neither
    assert run("tenant-a") == 32 and run(None) == 32 and run("tenant-b") == 32  # each its own 4 full blocks
    for bad in ("", 7):
        with pytest.raises(ValueError, match="'cache_salt' must be a non-empty string"):
            llm.generate([{"prompt_token_ids": prompt, "cache_salt": bad}], params, use_tqdm=False)
    beams = llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "tenant-c"}],
                            BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))
    assert beams[0].sequences[0].tokens == list(prompt) + expected
    assert run("tenant-c") == 32  # the beam steps ran under tenant-c's salt
    # a short prompt's partly filled block (offered by copy, as to beam forks) follows the same rule
    short, one = prompt[:5], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def cached(ids, salt):
        item = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
        return llm.generate([item], one, use_tqdm=False)[0].num_cached_tokens

    assert cached(short, "tenant-d") == 0
    assert [cached(short + [3], "tenant-e"), cached(short + [3], None), cached(short + [3], "tenant-d")] == [0, 0, 5]


def test_preemption_matches_hf(tiny_qwen3_dir):
    # 10 blocks of 8 tokens cannot hold 4 requests growing to ~40 tokens each: the newest get preempted
    # and recomputed, and still produce exactly transformers' tokens.
    llm = LLM(model=tiny_qwen3_dir, dtype="float32", num_gpu_blocks_override=10, block_size=8, max_model_len=80,
              enable_prefix_caching=False)
    prompts = random_prompts([12, 20, 7, 15], seed=5)
    check_against_hf(llm, tiny_qwen3_dir, prompts, [24, 18, 30, 20])
    assert llm.engine.get_stats().num_preemptions > 0


def test_preemption_with_prefix_cache_matches_hf(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=12, block_size=8, max_model_len=96,
              max_num_batched_tokens=16, max_num_seqs=4)
    shared = random_prompts([16], seed=6)[0]
    prompts = random_prompts([5, 9, 2, 14], seed=7, prefix=shared)
    check_against_hf(llm, tiny_llama_dir, prompts, [20, 25, 16, 22])
    assert llm.engine.get_stats().num_preemptions > 0


def test_pool_smaller_than_one_sequence_is_refused_at_start(tiny_llama_dir):
    """num_gpu_blocks_override below what one max_model_len sequence needs is refused at start, as a pool sized from
    memory is (it was accepted, and a request that outgrew the pool was cut short)."""
    with pytest.raises(ValueError, match=r"^num_gpu_blocks_override=8 KV blocks of 8 tokens hold 64 tokens, but "
                                         r"max_model_len is 128 \(one sequence needs 16 blocks\); lower "
                                         r"--max-model-len or raise --num-gpu-blocks-override to at least 16\.$"):
        LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=8, block_size=8, max_model_len=128)


def test_too_long_prompt_rejected_without_blocking(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=16, block_size=8, max_model_len=128)
    with pytest.raises(ValueError, match="maximum context length is 128"):
        llm.generate([{"prompt_token_ids": [5] * 200}], SamplingParams(max_tokens=4), use_tqdm=False)
    # The queue is not blocked: a normal request still completes.
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_async_scheduling_matches_hf(arch, tiny_model_dir):
    """Async scheduling (host work of step N+1 overlapping step N, the CUDA default) exercised on the CPU:
    mixed lengths, chunked prefill and preemption all still give transformers' exact tokens."""
    model_dir = tiny_model_dir(arch)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=14, block_size=8, max_num_batched_tokens=16,
              max_num_seqs=4, max_model_len=112, async_scheduling=True)
    assert llm.engine.async_scheduling
    prompts = random_prompts([1, 30, 9, 17, 4, 25], seed=21)
    check_against_hf(llm, model_dir, prompts, [12, 20, 7, 15, 24, 10])
    assert llm.engine.get_stats().num_preemptions > 0
    # EOS / stop ids and max_tokens stop exactly where synchronous scheduling stops, and nothing leaks.
    sync = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64, async_scheduling=False)
    params = [SamplingParams(temperature=0, max_tokens=m, stop_token_ids=[7, 11, 13, 200]) for m in (5, 40, 1, 17)]
    ps = [{"prompt_token_ids": p} for p in random_prompts([6, 3, 12, 8], seed=22)]
    a = llm.generate(ps, params, use_tqdm=False)
    b = sync.generate(ps, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in a] == \
        [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in b]
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.get_stats().kv_cache_usage == 0.0
    assert len(llm.engine.worker.runner.input_batch.requests) == 0 or all(
        r not in llm.engine.scheduler.requests for r in llm.engine.worker.runner.input_batch.requests)


def test_async_scheduling_seeded_and_penalized_requests_fall_back_to_sync(tiny_llama_dir):
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=5, repetition_penalty=1.3, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 9], seed=23)]
    outs = []
    for mode in (True, False):
        llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=32, async_scheduling=mode)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
    assert outs[0] == outs[1]


def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1] logprob of each prompt token after the first, from one transformers forward."""
    model = _hf_model(model_dir)
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    return lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1), lp[:-1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_hf_through_chunks_and_cache(tiny_llama_dir, async_scheduling):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64, block_size=8,
              max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=async_scheduling)
    prompts = random_prompts([37, 1, 20], seed=31)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=2), use_tqdm=False)  # cache
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=3, prompt_logprobs=k) for k in (3, 0, 1)], use_tqdm=False)
    for prompt, k, out in zip(prompts, (3, 0, 1), outs):
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        if len(prompt) == 1:
            continue
        ref, ref_all = hf_prompt_logprobs(tiny_llama_dir, prompt)
        got = torch.tensor([plp[i][prompt[i]].logprob for i in range(1, len(prompt))])
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=0)
        for i in range(1, len(prompt)):
            assert len(plp[i]) <= k + 1 and prompt[i] in plp[i]
            expected_rank = int((ref_all[i - 1] > ref_all[i - 1][prompt[i]]).sum()) + 1
            assert abs(plp[i][prompt[i]].rank - expected_rank) <= 1  # near-ties may swap by fp noise
            if k:
                best = int(ref_all[i - 1].argmax())
                assert best in plp[i] and plp[i][best].rank == 1
