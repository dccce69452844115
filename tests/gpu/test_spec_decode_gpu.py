"""Speculative decoding and beam search on CUDA: verify steps replay CUDA graphs (mixed-step buckets of k + 1
tokens per request), async scheduling stays on, greedy
output equals the same engine without speculation over whole outputs (fp32: token for token; bf16: up to a near-tie,
spec_checks.py), and sampled output (temperature 1, nothing filtered) has the target's distribution."""
from __future__ import annotations


import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from spec_checks import (assert_same_up_to_near_ties, check_overlapped_sampling, chi2_limit, mean_top_prob,
                         peaked_model, rank_fit, two_sample_chi2)
from tests.engine.test_correctness import random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def _prompts():
    """Repetitive prompts (n-gram drafts get accepted) and a random one."""
    base = random_prompts([24], seed=3)[0]
    more = [random_prompts([n], seed=30 + i)[0] * 2 for i, n in enumerate((7, 13, 19, 31, 5))]
    return [{"prompt_token_ids": p} for p in [base * 3, base[:10] * 4, random_prompts([40], seed=4)[0]] + more]


def _outputs(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _tokens(llm, prompts, params):
    return [o.token_ids for o in _outputs(llm, prompts, params)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ngram_on_cuda_graphs_equals_plain(tiny_llama_dir, dtype):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    common = dict(dtype=dtype, device="cuda", num_gpu_blocks_override=256, max_num_seqs=8)
    plain = LLM(tiny_llama_dir, **common)
    spec = LLM(tiny_llama_dir, speculative_config=NGRAM, **common)
    runner = spec.engine.worker.runner
    assert spec.engine.async_scheduling and runner.mixed_graphs is not None
    assert {5, 10, 20, 40} <= set(runner.mixed_graphs.sizes)  # exact verify buckets (k + 1) x batch
    if dtype == "float32":
        assert _tokens(spec, _prompts(), params) == _tokens(plain, _prompts(), params)
    else:  # the production path (greedy shortcut, no logprobs), then with logprobs to compare those too
        want = _outputs(plain, _prompts(), with_logprobs)
        assert_same_up_to_near_ties(_outputs(spec, _prompts(), params), want)
        assert_same_up_to_near_ties(_outputs(spec, _prompts(), with_logprobs), want, check_logprobs=True)
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0
    # verify steps launched while the previous one ran (drafts on the device, its rejections corrected there)
    assert runner.spec.device_ngram is not None and runner.spec.device_ngram.num_overlapped_steps > 0
    # batch 1: every verify step is one draft; each must have replayed a graph (2..5 tokens, exact buckets)
    before_replays, before_drafts = runner.mixed_graphs.num_replays, stats.num_drafts
    _tokens(spec, _prompts()[:1], params)
    assert stats.num_drafts > before_drafts
    assert runner.mixed_graphs.num_replays - before_replays >= stats.num_drafts - before_drafts
    del plain, spec


def test_device_ngram_on_cuda_equals_the_cpu():
    """The device n-gram proposer's torch ops on CUDA (int32 histories, unfold, amax, gather) propose what they do
    on the CPU, on histories long enough for several matches per row."""
    from pagedllm.spec_decode.device_ngram import propose_ngram

    gen = torch.Generator().manual_seed(0)
    for vocab, width in ((3, 64), (50, 2048)):
        hist = torch.randint(0, vocab, (16, width), generator=gen, dtype=torch.int32)
        lens = torch.randint(1, width + 1, (16,), generator=gen)
        for lo, hi in ((1, 4), (2, 3)):
            want = propose_ngram(hist, lens, 4, lo, hi)
            got = propose_ngram(hist.cuda(), lens.cuda(), 4, lo, hi)
            assert torch.equal(got[1].cpu(), want[1])
            for i, n in enumerate(want[1].tolist()):
                assert torch.equal(got[0][i, :n].cpu(), want[0][i, :n])


def test_draft_model_greedy_and_top_k_1_on_cuda(tiny_llama_dir):
    """Whole greedy outputs equal without speculation; temperature 0.9 with top_k=1 takes the sampled rows'
    path through the rejection sampler (filters, not the argmax shortcut) and must give the same tokens."""
    common = dict(dtype="float32", device="cuda", num_gpu_blocks_override=256, max_num_seqs=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = LLM(tiny_llama_dir, **common)
    draft = LLM(tiny_llama_dir, speculative_config={"method": "draft_model", "model": tiny_llama_dir,
                                                    "num_speculative_tokens": 3}, **common)
    assert _tokens(draft, _prompts(), greedy) == _tokens(plain, _prompts(), greedy)
    assert draft.engine.scheduler.spec_stats.acceptance_rate > 0.95
    proposer = draft.engine.worker.runner.spec.proposer
    assert proposer.num_graph_forwards > 0  # the draft's steps replay its own CUDA graphs
    # Requests near their max_tokens want fewer drafts than the others of the step (padding rows of the chain).
    varied = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 9, 30, 14, 2, 23, 17, 11)]
    assert _tokens(draft, _prompts(), varied) == _tokens(plain, _prompts(), varied)
    eager = LLM(tiny_llama_dir, enforce_eager=True, speculative_config={
        "method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3}, **common)
    assert _tokens(eager, _prompts(), varied) == _tokens(plain, _prompts(), varied)
    assert eager.engine.worker.runner.spec.proposer.num_graph_forwards == 0
    top1 = SamplingParams(temperature=0.9, top_k=1, max_tokens=30, ignore_eos=True)
    assert _tokens(draft, _prompts(), top1) == _tokens(plain, _prompts(), top1)
    del plain, draft, eager


def test_draft_model_on_cuda_through_chunked_prefill_prefix_hits_and_preemption(tiny_llama_dir):
    """The draft's catch-up in chunks of the step budget (mixed graphs and eager), its one-token steps on its decode
    graphs, a target whose requests are preempted and hit the prefix cache: whole greedy outputs equal the plain
    engine's in fp32."""
    spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    common = dict(dtype="float32", device="cuda", max_num_seqs=4)
    plain = _tokens(LLM(tiny_llama_dir, num_gpu_blocks_override=256, **common), _prompts(), params)
    chunked = LLM(tiny_llama_dir, speculative_config=spec, num_gpu_blocks_override=256, max_num_batched_tokens=32,
                  **common)
    assert _tokens(chunked, _prompts(), params) == plain
    hits = chunked.engine.get_stats().prefix_cache_hits
    assert _tokens(chunked, _prompts(), params) == plain
    assert chunked.engine.get_stats().prefix_cache_hits > hits
    assert chunked.engine.worker.runner.spec.proposer.num_graph_forwards > 0
    small = LLM(tiny_llama_dir, speculative_config=spec, num_gpu_blocks_override=24, max_model_len=384, **common)
    assert _tokens(small, _prompts(), params) == plain
    assert small.engine.get_stats().num_preemptions > 0
    assert small.engine.scheduler.spec_stats.acceptance_rate > 0.95
    del chunked, small


def test_draft_model_sampling_keeps_the_target_distribution(tiny_llama_dir, tmp_path):
    """bf16, temperature 1, no top-k/top-p, 2000 seeded requests of one prompt, 4 tokens each, the target as its
    own draft (its drafts are the most likely tokens, accepted with probability p(draft) by a correct sampler):
    - every emitted token fits the distribution the engine reports for it (rank_fit over the top 5 and the rest),
      the verified positions (1-3) and the prefill's (0) alike, with and without speculation;
    - at each position the token histograms with and without speculation agree (two-sample chi-square);
    - the first draft is accepted about as often as the most likely token's probability.
    Accepting every draft or resampling from p with the rejected draft included puts more mass on rank 1 at
    positions 1-3 by many standard deviations, and never accepting fails the acceptance check (each bug was
    simulated on the CPU engine against this test)."""
    model = peaked_model(tiny_llama_dir, str(tmp_path / "peaked"))
    n = 2000
    prompt = {"prompt_token_ids": random_prompts([12], seed=21)[0]}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True, logprobs=5) for i in range(n)]
    common = dict(dtype="bfloat16", device="cuda", num_gpu_blocks_override=1024, max_num_seqs=256)
    # disable_by_batch_size None: speculate at any load (by default a batch this large is not speculated)
    spec_config = {"method": "draft_model", "model": model, "num_speculative_tokens": 3,
                   "disable_by_batch_size": None}
    results = {}
    for name, extra in (("plain", {}), ("spec", {"speculative_config": spec_config})):
        llm = LLM(model, **common, **extra)
        results[name] = _outputs(llm, [prompt] * n, params)
        if name == "spec":
            stats = llm.engine.scheduler.spec_stats
        del llm
    for name, outs in results.items():
        assert all(len(o.token_ids) == 4 for o in outs)
        for positions in ([0], [1, 2, 3]):
            stat, dof, z = rank_fit(outs, positions)
            assert stat < chi2_limit(dof), (name, positions, stat, dof, z)
    for j in range(4):
        stat, dof = two_sample_chi2([o.token_ids[j] for o in results["plain"]],
                                    [o.token_ids[j] for o in results["spec"]])
        assert dof >= 5 and stat < chi2_limit(dof), (j, stat, dof)
    assert stats.num_drafts > n  # (most requests verify drafts in more than one step)
    first_accepted = stats.num_accepted_tokens_per_pos[0] / stats.num_drafts
    expected = mean_top_prob(results["spec"], [1, 2, 3])
    assert 0.2 < expected < 0.8 and abs(first_accepted - expected) < 0.1, (first_accepted, expected)


@pytest.mark.parametrize("copies", ["0", "1"])
def test_beam_search_on_cuda_equals_cpu(tiny_llama_dir, monkeypatch, copies):
    """Beams on CUDA equal the CPU's, with and without the opt-in partial-block copies at beam forks."""
    monkeypatch.setenv("PAGEDLLM_PARTIAL_BLOCK_COPIES", copies)
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 13], seed=8)]
    gpu_llm = LLM(tiny_llama_dir, dtype="float32", device="cuda", num_gpu_blocks_override=256)
    gpu = gpu_llm.beam_search(prompts, params)
    assert (gpu_llm.engine.scheduler.kv_cache_manager.num_partial_block_copies > 0) == (copies == "1")
    cpu = LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 24).beam_search(prompts, params)
    for a, b in zip(gpu, cpu):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences):
            assert x.score == pytest.approx(y.score, abs=1e-3)


def test_overlapped_ngram_sampling_keeps_the_target_distribution_on_cuda(tiny_llama_dir, tmp_path):
    """tests/engine/test_spec_decode.py's distribution test on CUDA: the overlapped verify steps' Triton kernels
    (acceptance from the rejection sampler's verdicts, padded device drafts) keep every emitted token on the
    distribution the engine reports for it."""
    model = peaked_model(tiny_llama_dir, str(tmp_path / "peaked"))
    llm = LLM(model, dtype="float32", device="cuda", num_gpu_blocks_override=4096, max_num_seqs=256,
              max_model_len=512, speculative_config=dict(NGRAM, disable_by_batch_size=None))
    assert llm.engine.worker.runner.spec.device_ngram is not None
    check_overlapped_sampling(llm, random_prompts([12], seed=23)[0])


def test_seeded_request_does_not_depend_on_batch_mates_drafts(tiny_llama_dir):
    """A seeded request's tokens under n-gram speculation on CUDA are the same alone and beside batch-mates whose
    repetitive prompts bring drafts: its draft-free rows in a verify step draw with the device sampler's
    (seed, position) key, as its plain steps do."""
    llm = LLM(tiny_llama_dir, dtype="float32", device="cuda", num_gpu_blocks_override=512, max_num_seqs=8,
              speculative_config=dict(NGRAM, disable_by_batch_size=None))
    mates = _prompts()[:2] + _prompts()[3:5]
    stats = llm.engine.scheduler.spec_stats
    for seed in (1, 2, 3):
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=24, ignore_eos=True)
        mine = {"prompt_token_ids": random_prompts([17], seed=100 + seed)[0]}
        alone = _tokens(llm, [mine], params)[0]
        drafts_before = stats.num_drafts
        mate_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        together = llm.generate([mine] + mates, [params] + [mate_params] * len(mates), use_tqdm=False)
        assert stats.num_drafts > drafts_before  # the mates did bring drafts
        assert list(together[0].outputs[0].token_ids) == list(alone), seed
