"""Gemma 2, Gemma 3 and Phi-3 through the real engine (paged KV cache, continuous batching) against transformers'
greedy tokens and logprobs (tests/engine/test_correctness.py's reference): mixed batches on the CPU and torch
attention backends (Gemma 2's soft-capped attention takes its own path on both), chunked prefill, prefix-cache
hits, preemption, Phi-3's LongRoPE on each side of its original context, and prompts longer than the sliding
window (Gemma 2 / Gemma 3 local layers)."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.engine.test_correctness import check_against_hf, hf_greedy, random_prompts

LENGTHS, MAX_TOKENS = [1, 5, 17, 33, 64, 3], [12, 7, 20, 9, 15, 24]


@pytest.mark.parametrize("arch,backend", [("gemma2", "cpu"), ("gemma2", "torch"), ("gemma3", "cpu"),
                                          ("gemma3", "torch"), ("phi3_plain", "cpu")])
def test_mixed_batch_matches_hf(tiny_model_dir, arch, backend):
    model_dir = tiny_model_dir(arch)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64, attention_backend=backend)
    check_against_hf(llm, model_dir, random_prompts(LENGTHS, seed=1), MAX_TOKENS)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_plain_greedy_matches_hf(tiny_model_dir, arch):
    """Greedy without logprobs: Gemma 3 takes the CPU LM head's argmax shortcut (where this CPU builds its bf16
    screen), Gemma 2 (final soft-cap) the full logits; both transformers' tokens."""
    model_dir = tiny_model_dir(arch)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64)
    model = llm.engine.worker.model
    # AVX2-only CPUs have no bf16 oneDNN linear, so no screen: every model there takes the full logits.
    shortcut = arch == "gemma3" and model.lm_head.__dict__.get("cpu_greedy_screen") is not None
    answered = []  # what the model's argmax shortcut returned per step (None: the runner computes full logits)
    real = model.greedy_token_ids

    def spy(hidden, *args):
        answered.append(real(hidden, *args))
        return answered[-1]

    model.greedy_token_ids = spy
    prompts = random_prompts([1, 9, 30], seed=21)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 10)[0]
    assert answered and all((a is not None) == shortcut for a in answered)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3_plain"])
def test_chunked_prefill_matches_hf(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    llm = LLM(model=model_dir, dtype="float32", max_num_batched_tokens=8, max_num_seqs=4, num_gpu_blocks_override=64)
    check_against_hf(llm, model_dir, random_prompts([40, 3, 27, 9, 50], seed=2), [10, 14, 6, 12, 8])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_prefix_cache_hits_match_hf(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64, block_size=8)
    shared = random_prompts([37], seed=3)[0]
    prompts = random_prompts([0, 4, 11, 1], seed=4, prefix=shared)
    check_against_hf(llm, model_dir, prompts[:1], [6])
    outs = check_against_hf(llm, model_dir, prompts, [9, 5, 13, 7])
    assert [o.num_cached_tokens >= 32 for o in outs] == [True] * 4


def test_preemption_matches_hf(tiny_model_dir):
    model_dir = tiny_model_dir("gemma3")
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=10, block_size=8, max_model_len=80,
              enable_prefix_caching=False)
    check_against_hf(llm, model_dir, random_prompts([12, 20, 7, 15], seed=5), [24, 18, 30, 20])
    assert llm.engine.get_stats().num_preemptions > 0


def test_phi3_short_and_long_context(tiny_model_dir):
    """max_model_len within the original context (32): the short factors, transformers' for every sequence there;
    past it (the model's 256): the long factors, transformers' for every sequence longer than 32 tokens."""
    model_dir = tiny_model_dir("phi3")
    short = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64, max_model_len=32)
    check_against_hf(short, model_dir, random_prompts([1, 5, 17, 25], seed=6), [8, 12, 10, 7])
    long = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=16,
               max_num_seqs=4)  # chunks of 16: the long factors in every prefill chunk and decode
    check_against_hf(long, model_dir, random_prompts([33, 40, 60], seed=7), [10, 6, 12])


# ------------------------------------------------------------------------ past the sliding window (16 tokens)

@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory):
    """gemma2 / gemma3 with a 16-token window, so prompts of 40-70 tokens reach far past it on the local layers."""
    from tests.conftest import save_tiny_model, tiny_hf_config
    dirs = {}
    for arch in ("gemma2", "gemma3"):
        config = tiny_hf_config(arch)
        config.sliding_window = 16
        dirs[arch] = save_tiny_model(str(tmp_path_factory.mktemp(f"{arch}-window16")), config)
    return dirs


def test_window_changes_the_reference(windowed_dirs, tiny_model_dir):
    """The long prompts below would not test the window if transformers' tokens did not depend on it."""
    prompt = random_prompts([60], seed=8)[0]
    for arch, model_dir in windowed_dirs.items():
        assert hf_greedy(model_dir, prompt, 12)[0] != hf_greedy(tiny_model_dir(arch), prompt, 12)[0], arch


@pytest.mark.parametrize("arch,backend", [("gemma2", "cpu"), ("gemma2", "torch"), ("gemma3", "cpu"),
                                          ("gemma3", "torch")])
def test_past_the_window_matches_hf(windowed_dirs, arch, backend):
    model_dir = windowed_dirs[arch]
    # gemma3's five windowed layers are five KV-cache groups beside the full one: 6 x 64 blocks for one sequence
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=384, block_size=8, attention_backend=backend)
    check_against_hf(llm, model_dir, random_prompts([60, 3, 41, 17, 70], seed=8), [12, 30, 9, 20, 6])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_past_the_window_chunked_and_prefix_hits(windowed_dirs, arch):
    model_dir = windowed_dirs[arch]
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64, block_size=8, max_model_len=128,
              max_num_batched_tokens=8, max_num_seqs=4)
    shared = random_prompts([41], seed=9)[0]
    prompts = random_prompts([0, 9, 22], seed=10, prefix=shared)
    check_against_hf(llm, model_dir, prompts[:1], [5])
    outs = check_against_hf(llm, model_dir, prompts, [14, 8, 11])
    assert all(o.num_cached_tokens >= 40 for o in outs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_phi3_per_request_factors_and_crossing_the_original_context(tiny_model_dir, async_scheduling):
    """One engine (context 256 > the original 32) with requests on both sides of the original context and requests
    that grow across it: each gets transformers' logits for its own length (short factors up to 32 tokens, long
    past it, the whole sequence recomputed with the long ones at the crossing, as transformers does). Before, the
    engine chose once for its context: every request was rotated with the long factors."""
    model_dir = tiny_model_dir("phi3")
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=96, block_size=8, max_num_batched_tokens=16,
              max_num_seqs=8, async_scheduling=async_scheduling)
    # 5 + 6 stays short; 20 + 20, 28 + 9, 31 + 4 and 32 + 8 cross; 33 and 45 are long from the start
    prompts = random_prompts([5, 20, 28, 31, 32, 33, 45], seed=11)
    check_against_hf(llm, model_dir, prompts, [6, 20, 9, 4, 8, 6, 10])
    assert llm.engine.get_stats().num_preemptions >= 4  # the crossings' recomputes
    # The prefix cache keeps the two rotations apart: a long request sharing a short one's prefix computes its own
    # blocks; a short one sharing it hits them.
    shared = random_prompts([24], seed=12)[0]
    check_against_hf(llm, model_dir, [shared], [2])
    short, long = random_prompts([4, 20], seed=13, prefix=shared)
    out_short, out_long = check_against_hf(llm, model_dir, [short, long], [3, 3])
    assert out_short.num_cached_tokens >= 16 and out_long.num_cached_tokens == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_phi3_speculative_drafts_across_the_original_context(tiny_model_dir, async_scheduling):
    """n-gram drafts of a request rotated with the short factors stop at the original context (their logits past
    it need the long factors: the request is recomputed first), so its tokens stay transformers'."""
    base = random_prompts([8], seed=14)[0]
    prompts = [base * 3, base[:5] * 4 + base[:3]]  # repeats: drafts found and accepted, both cross 32
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llm = LLM(model=tiny_model_dir("phi3"), dtype="float32", num_gpu_blocks_override=96, block_size=8,
              speculative_config=spec, async_scheduling=async_scheduling)
    check_against_hf(llm, tiny_model_dir("phi3"), prompts, [24, 20])
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
