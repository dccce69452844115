"""Sliding-window models through the real engine against transformers: Mistral (a 32-token window on every layer)
and Qwen3 mixing sliding and full layers (several KV-cache groups), on prompts much longer than the window, in mixed
batches, chunked prefill, prefix hits, preemption, speculative decoding and async scheduling; and the KV pool they
use: a long sequence on sliding layers holds about window / block_size blocks, whatever its length."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.block_hash import hash_full_blocks
from tests.engine.test_correctness import check_against_hf, hf_greedy, random_prompts
from tests.models.swa_helpers import save_swa_model

WINDOW = 32
BS = 8
# Qwen3, five layers: three sliding (window 24), two full. Groups of two layers: [0, 1], [3] (one empty place),
# [2, 4] (core/kv_cache_groups.py).
MIXED_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
MIXED_WINDOW = 24


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return save_swa_model(str(tmp_path_factory.mktemp("mistral-swa")), "mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory):
    return save_swa_model(str(tmp_path_factory.mktemp("qwen3-mixed")), "qwen3", num_hidden_layers=5,
                          use_sliding_window=True, sliding_window=MIXED_WINDOW, layer_types=MIXED_TYPES)


def full_attention_greedy(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens with the window removed (every layer full attention): what a wrong mask gives."""
    from transformers import AutoModelForCausalLM

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type == "mistral":
        config.sliding_window = None
    else:  # Qwen3: every layer a full one
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


class PoolWatch:
    """After every schedule(): the pool's blocks in use, and per KV-cache group the blocks a request holds."""

    def __init__(self, llm: LLM, request_id=None) -> None:
        self.kv = llm.engine.scheduler.kv_cache_manager
        self.used: list[int] = []
        self.held: list[list[int]] = []  # per step, per group: blocks held by the watched request
        self.request_id = request_id
        scheduler = llm.engine.scheduler
        schedule = scheduler.schedule

        def watched(*args, **kwargs):
            plan = schedule(*args, **kwargs)
            self.used.append(self.kv.block_pool.num_used_blocks)
            rid = self.request_id or next(iter(self.kv.req_to_blocks), None)
            if rid is not None and rid in self.kv.req_to_blocks:
                self.held.append([sum(b is not None for b in g[rid]) for g in self.kv.group_blocks])
            return plan

        scheduler.schedule = watched


def test_mistral_long_prompts_match_hf_in_a_mixed_batch(mistral_dir):
    llm = LLM(model=mistral_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=256)
    assert [a.sliding_window for a in llm.engine.worker.model.attn_layers] == [WINDOW, WINDOW]
    assert llm.engine.scheduler.kv_cache_manager.group_windows == (WINDOW,)
    prompts = random_prompts([3, 20, 70, 130, 200, 32, 33], seed=11)
    max_tokens = [60, 25, 20, 12, 8, 30, 30]
    check_against_hf(llm, mistral_dir, prompts, max_tokens)
    # The test can fail: without the window transformers gives other tokens for the long prompts.
    assert any(full_attention_greedy(mistral_dir, p, m) != hf_greedy(mistral_dir, p, m)[0]
               for p, m in zip(prompts[2:5], max_tokens[2:5]))


@pytest.mark.parametrize("budget", [8, 48])
def test_mistral_chunked_prefill_matches_hf(mistral_dir, budget):
    """Chunks shorter and longer than the window, interleaved with other requests' decodes."""
    llm = LLM(model=mistral_dir, dtype="float32", block_size=BS, max_num_batched_tokens=budget, max_num_seqs=4,
              num_gpu_blocks_override=256)
    prompts = random_prompts([90, 9, 150, 33], seed=12)
    check_against_hf(llm, mistral_dir, prompts, [14, 20, 9, 17])


def test_mistral_prefix_hits_match_hf(mistral_dir):
    llm = LLM(model=mistral_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=256)
    shared = random_prompts([70], seed=13)[0]
    prompts = random_prompts([0, 5, 23, 2], seed=14, prefix=shared)
    check_against_hf(llm, mistral_dir, prompts[:1], [30])  # fills the cache; its early blocks fall out of its window
    before = llm.engine.get_stats().prefix_cache_hits
    outs = check_against_hf(llm, mistral_dir, prompts, [12, 7, 19, 9])
    assert llm.engine.get_stats().prefix_cache_hits - before >= 4 * 64
    assert all(o.num_cached_tokens >= 64 for o in outs), [o.num_cached_tokens for o in outs]


def test_mistral_hits_skip_evicted_blocks_before_the_window(mistral_dir):
    """The blocks of a long request that fell out of its window are freed first (oldest first), so other requests'
    allocations evict them. A later request with the same prefix still hits: it needs only the blocks its window
    sees. One whose window needs an evicted block gets no hit there. Its tokens are transformers' either way."""
    llm = LLM(model=mistral_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=40, max_model_len=320)
    kv = llm.engine.scheduler.kv_cache_manager
    long_prompt = random_prompts([100], seed=15)[0]
    hashes = hash_full_blocks(long_prompt, BS)
    check_against_hf(llm, mistral_dir, [long_prompt], [4])  # blocks 0..12; decoding frees 0..8 (still cached)
    assert all(kv.block_pool.get_cached_block(h) is not None for h in hashes)
    check_against_hf(llm, mistral_dir, random_prompts([80, 80, 80], seed=16), [1, 1, 1])  # 30 blocks: evicts 0..2
    assert [kv.block_pool.get_cached_block(h) is None for h in hashes] == [True] * 3 + [False] * 9
    outs = check_against_hf(llm, mistral_dir, [long_prompt + [5, 6, 7], long_prompt[:40] + [5, 6]], [8, 8])
    # 12 blocks of hits: its window (positions from 65 on) needs blocks 8..11, which are still cached
    assert outs[0].num_cached_tokens == 96
    # a hit of 5 blocks needs blocks 1..4, of 4 blocks 0..3, ...: block 0, 1 or 2 is gone in each case
    assert outs[1].num_cached_tokens == 0


def test_mistral_preemption_matches_hf(mistral_dir):
    # 20 blocks of 8 tokens; four 100-token prompts in chunks of 16 need about 7 each at once: preemptions.
    llm = LLM(model=mistral_dir, dtype="float32", block_size=BS, max_num_batched_tokens=16, max_num_seqs=4,
              num_gpu_blocks_override=20)
    prompts = random_prompts([100, 101, 102, 103], seed=18)
    check_against_hf(llm, mistral_dir, prompts, [20, 20, 20, 20])
    assert llm.engine.get_stats().num_preemptions > 0


def test_long_sequence_uses_bounded_blocks(mistral_dir):
    """A 40-token prompt generating 400 tokens in a pool of 16 blocks (128 tokens): full attention would need 55
    blocks; with the window it never holds more than window / block_size + 2. (Steps of 32 tokens: a longer prefill
    chunk would need more blocks at once than the pool has.)"""
    llm = LLM(model=mistral_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=16, max_model_len=512,
              max_num_batched_tokens=32, max_num_seqs=4)
    watch = PoolWatch(llm)
    prompt = random_prompts([40], seed=19)[0]
    check_against_hf(llm, mistral_dir, [prompt], [400])
    decode = watch.used[1:]
    assert len(decode) >= 399 and max(decode) <= WINDOW // BS + 2, max(decode)
    assert max(watch.used) <= max(-(-40 // BS), WINDOW // BS + 2)


def test_mistral_speculative_decoding_and_async_scheduling_match_hf(mistral_dir):
    rng_prompts = random_prompts([24], seed=20)
    prompts = [rng_prompts[0] * 4, random_prompts([70], seed=21)[0]]  # repeats: n-gram drafts get accepted
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    for kw in ({"speculative_config": spec}, {"async_scheduling": True},
               {"speculative_config": spec, "async_scheduling": True}):
        llm = LLM(model=mistral_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=64, **kw)
        check_against_hf(llm, mistral_dir, prompts, [40, 30])
        if "speculative_config" in kw:
            assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
        if len(kw) == 2:  # verify steps overlapped: the window's blocks kept for the true positions, not the planned
            assert llm.engine.worker.runner.spec.device_ngram.num_overlapped_steps > 0


def test_mixed_layers_overlapped_speculation_matches_hf(mixed_dir):
    """Sliding and full layers (three KV-cache groups) with n-gram drafts and async scheduling: verify steps overlap,
    every group's slot mapping is corrected on the device, each window's blocks are kept for the true positions."""
    rng_prompts = random_prompts([20], seed=24)
    prompts = [rng_prompts[0] * 4, random_prompts([60], seed=25)[0], rng_prompts[0][:9] * 5]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llm = LLM(model=mixed_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=200, max_num_seqs=4,
              speculative_config=spec, async_scheduling=True)
    check_against_hf(llm, mixed_dir, prompts, [40, 30, 36])
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert llm.engine.worker.runner.spec.device_ngram.num_overlapped_steps > 0


def test_mixed_sliding_and_full_layers_match_hf(mixed_dir):
    llm = LLM(model=mixed_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=400, max_num_batched_tokens=24,
              max_num_seqs=4)
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.group_windows == (MIXED_WINDOW, MIXED_WINDOW, None)
    runner = llm.engine.worker.runner
    assert len(runner.kv_caches) == 2 and runner.layer_group == [0, 0, 2, 1, 2]
    prompts = random_prompts([90, 4, 33, 150], seed=22)
    check_against_hf(llm, mixed_dir, prompts, [16, 40, 12, 10])
    assert any(full_attention_greedy(mixed_dir, p, 10) != hf_greedy(mixed_dir, p, 10)[0] for p in prompts[::3])
    # prefix hits across groups: the full group needs every block, the sliding ones their window
    shared = prompts[0]
    outs = check_against_hf(llm, mixed_dir, [shared + [3, 4, 5], shared[:50] + [9]], [9, 9])
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] >= 88 and cached[1] >= 48, cached


def test_mixed_layers_bound_only_the_sliding_groups(mixed_dir):
    llm = LLM(model=mixed_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=200, max_model_len=512)
    watch = PoolWatch(llm)
    check_against_hf(llm, mixed_dir, random_prompts([20], seed=23), [200])
    first_sliding, second_sliding, full = zip(*watch.held[1:])
    assert max(first_sliding) <= MIXED_WINDOW // BS + 2 and max(second_sliding) <= MIXED_WINDOW // BS + 2
    assert max(full) == -(-(20 + 199) // BS)  # the full group keeps every block


def test_mixed_layers_preemption_matches_hf(mixed_dir):
    llm = LLM(model=mixed_dir, dtype="float32", block_size=BS, max_num_batched_tokens=16, max_num_seqs=4,
              num_gpu_blocks_override=40, max_model_len=128)
    check_against_hf(llm, mixed_dir, random_prompts([40, 41, 42, 43], seed=24), [12, 12, 12, 12])
    assert llm.engine.get_stats().num_preemptions > 0


def test_prompt_longer_than_the_pool_runs_on_sliding_layers(mistral_dir):
    """Every layer sliding: a prompt longer than the whole pool is accepted and computed chunk by chunk."""
    llm = LLM(model=mistral_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=20, max_num_batched_tokens=32,
              max_num_seqs=4, max_model_len=512)
    prompt = random_prompts([250], seed=25)[0]
    check_against_hf(llm, mistral_dir, [prompt], [5])
    # In steps of the default 2048 tokens a max_model_len prompt needs all its 64 blocks at once: refused at start.
    with pytest.raises(ValueError, match="hold 160 tokens, but max_model_len is 512"):
        LLM(model=mistral_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=20)


def test_torch_backend_and_fp8_cache_keep_the_window(mistral_dir):
    """The torch backend (the CPU path of an FP8 cache) is transformers' exactly; with an FP8 cache the first
    token's top logprobs stay within E4M3 rounding of transformers' windowed ones, farther from full attention's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    prompts = random_prompts([130, 70], seed=26)
    check_against_hf(LLM(model=mistral_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=64,
                         attention_backend="torch"), mistral_dir, prompts, [10, 10])
    llm = LLM(model=mistral_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=64, kv_cache_dtype="fp8")
    assert llm.engine.worker.runner.attn_backend.name == "torch"
    out = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0].outputs[0].logprobs[0]
    tokens = sorted(out)
    got = torch.tensor([out[t].logprob for t in tokens])
    config = AutoConfig.from_pretrained(mistral_dir)
    refs = []
    for window in (WINDOW, None):
        config.sliding_window = window
        model = AutoModelForCausalLM.from_pretrained(mistral_dir, config=config, dtype=torch.float32).eval()
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([prompts[0]]), use_cache=False).logits[0, -1], -1)
        refs.append(lp[tokens])
    windowed, full = ((got - r).abs().max().item() for r in refs)
    assert windowed < 0.05 and full > 5 * windowed, (windowed, full)


@pytest.mark.parametrize("arch", ["mistral", "qwen3-mixed", "gemma3"])
def test_disable_sliding_window_attends_fully_within_the_capped_context(arch, mistral_dir, mixed_dir, tiny_model_dir):
    """vLLM's disable_sliding_window: every layer (Gemma 3's and Qwen3's local ones too) attends to the whole
    context, and max_model_len is capped at the window, which the engine reports; a longer one is refused. Within
    the cap the tokens are transformers' full-attention greedy ones (for Gemma 3, whose local layers keep their rope,
    the model as saved: within its window that is full attention)."""
    model_dir, window = {"mistral": (mistral_dir, WINDOW), "qwen3-mixed": (mixed_dir, MIXED_WINDOW),
                         "gemma3": (tiny_model_dir("gemma3", sliding_window=16), 16)}[arch]
    llm = LLM(model=model_dir, dtype="float32", block_size=BS, num_gpu_blocks_override=16,
              disable_sliding_window=True)
    assert llm.engine.max_model_len == window
    assert all(a.sliding_window is None for a in llm.engine.worker.model.attn_layers)
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.num_groups == 1 and kv.sliding_window is None
    prompt = random_prompts([window - 6], seed=5)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    want = hf_greedy(model_dir, prompt, 6)[0] if arch == "gemma3" else full_attention_greedy(model_dir, prompt, 6)
    assert list(out[0].outputs[0].token_ids) == want
    with pytest.raises(ValueError, match=f"maximum context length is {window} tokens"):
        llm.generate([prompt + [7] * 6], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.shutdown()
    with pytest.raises(ValueError, match=f"max_model_len={window + 1} is larger than the model's maximum "
                                         f"\\(its sliding window, {window} tokens"):
        LLM(model=model_dir, max_model_len=window + 1, disable_sliding_window=True)


def test_disable_sliding_window_leaves_models_without_one_alone(tiny_llama_dir, tmp_path):
    """A model with no window (or Qwen2's use_sliding_window: false) keeps its context, as in vLLM; the flag parses
    on the command line and in a --config file."""
    import argparse

    from pagedllm.entrypoints.openai.cli_args import add_serve_args, parse_serve_args, to_engine_args

    def serve(argv):
        return to_engine_args(parse_serve_args(add_serve_args(argparse.ArgumentParser(), positional_model=True), argv))

    assert serve(["m", "--disable-sliding-window"]).disable_sliding_window
    (tmp_path / "serve.yaml").write_text("disable-sliding-window: true\n")
    assert serve(["m", "--config", str(tmp_path / "serve.yaml")]).disable_sliding_window
    assert not serve(["m"]).disable_sliding_window
    off = save_swa_model(str(tmp_path / "qwen2"), "qwen2", use_sliding_window=False, sliding_window=16)
    for model_dir in (tiny_llama_dir, off):
        llm = LLM(model=model_dir, num_gpu_blocks_override=32, disable_sliding_window=True)
        assert llm.engine.max_model_len == 512
        llm.shutdown()
