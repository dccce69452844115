"""Speculative decoding through the real engine: greedy output is identical with and without it (n-gram and
draft model; chunked prefill, prefix hits, preemption, sync and async scheduling), sampling keeps its rules,
a draft model of the target itself accepts ~everything, an unrelated one little, and bad configs fail at start."""
from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def _prompts(seed=0, vocab=512):
    rng = random.Random(seed)
    base = [rng.randrange(2, vocab) for _ in range(24)]
    return [base * 3,  # repeats: n-gram lookup hits
            base[:12] * 4 + [7, 8],
            [rng.randrange(2, vocab) for _ in range(70)],  # no repeats
            base[:5] + [rng.randrange(2, vocab) for _ in range(9)]]


def _llm(model, **kw):
    kw.setdefault("kv_cache_memory_bytes", 1 << 24)
    kw.setdefault("max_model_len", 256)
    return LLM(model, **kw)


def _tokens(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    cache = {}

    def get(arch, prompts, params=GREEDY, **kw):
        key = (arch, repr(prompts), repr(params), repr(sorted(kw.items())))
        if key not in cache:
            cache[key] = _tokens(_llm(tiny_model_dir(arch), **kw), prompts, params)
        return cache[key]
    return get


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_greedy_identical(tiny_model_dir, reference, arch, async_scheduling):
    prompts = _prompts()
    llm = _llm(tiny_model_dir(arch), speculative_config=NGRAM, async_scheduling=async_scheduling, block_size=8)
    assert _tokens(llm, prompts, GREEDY) == reference(arch, prompts)
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert llm.engine.num_steps < 4 * 40  # fewer steps than one token each


def test_ngram_greedy_identical_without_the_argmax_shortcut(tiny_model_dir, reference):
    """bf16 on the CPU: the LM head has no exact argmax shortcut there, so all-greedy verify steps take the
    sampler's path (drafts copied to the device when needed) and must still match the plain engine."""
    prompts = _prompts()
    llm = _llm(tiny_model_dir("llama"), speculative_config=NGRAM, dtype="bfloat16")
    assert _tokens(llm, prompts, GREEDY) == reference("llama", prompts, dtype="bfloat16")
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method,async_scheduling", [("ngram", False), ("ngram", True), ("draft_model", False)])
def test_identical_through_chunked_prefill_prefix_hits_and_preemption(tiny_model_dir, reference, method,
                                                                      async_scheduling):
    """With async scheduling the n-gram verify steps overlap (device drafts, corrected positions): rollbacks of a
    step in flight, preemptions of a request whose verify step is in flight, prefix hits on its blocks."""
    prompts = _prompts(1)
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": tiny_model_dir("llama"),
                                            "num_speculative_tokens": 3}
    kw = {"async_scheduling": async_scheduling}
    # chunked prefill: 32-token steps
    llm = _llm(tiny_model_dir("llama"), speculative_config=spec, max_num_batched_tokens=32, max_num_seqs=4, **kw)
    assert _tokens(llm, prompts, GREEDY) == reference("llama", prompts)
    # prefix hits: the same prompts again, from the cache
    hits_before = llm.engine.get_stats().prefix_cache_hits
    assert _tokens(llm, prompts, GREEDY) == reference("llama", prompts)
    assert llm.engine.get_stats().prefix_cache_hits > hits_before
    # preemption: a pool of 24 blocks of 16 tokens for four requests that need ~30
    small = _llm(tiny_model_dir("llama"), speculative_config=spec, num_gpu_blocks_override=24, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    assert _tokens(small, prompts, params) == reference("llama", prompts, params)
    assert small.engine.get_stats().num_preemptions > 0
    assert small.engine.scheduler.spec_stats.num_accepted_tokens > 0
    if async_scheduling:
        for engine in (llm, small):
            assert engine.engine.worker.runner.spec.device_ngram.num_overlapped_steps > 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=1, max_tokens=30, ignore_eos=True),  # sampled path, one-token support
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.0, min_tokens=10, max_tokens=30),
], ids=["sampled-top_k1", "penalties", "min_tokens"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_keeps_sampling_rules(tiny_model_dir, reference, params, async_scheduling):
    prompts = _prompts(2)
    llm = _llm(tiny_model_dir("llama"), speculative_config=NGRAM, async_scheduling=async_scheduling)
    assert _tokens(llm, prompts, params) == reference("llama", prompts, params)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_logprobs_and_seeds(tiny_model_dir, async_scheduling):
    prompts = _prompts(3)
    lp_params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    plain = _llm(tiny_model_dir("llama")).generate([{"prompt_token_ids": p} for p in prompts], lp_params,
                                                   use_tqdm=False)
    spec_llm = _llm(tiny_model_dir("llama"), speculative_config=NGRAM, async_scheduling=async_scheduling)
    spec = spec_llm.generate([{"prompt_token_ids": p} for p in prompts], lp_params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.outputs[0].logprobs) == 20
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) < 1e-4
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=25, ignore_eos=True)
    first = _tokens(spec_llm, prompts, seeded)
    assert first == _tokens(spec_llm, prompts, seeded)
    assert all(len(t) == 25 for t in first)
    # each row draws as a plain step would and keeps the drafts that match: the tokens of plain sampling
    assert first == _tokens(_llm(tiny_model_dir("llama")), prompts, seeded)
    assert spec_llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_draft_model_self_and_unrelated(tiny_model_dir, reference, tmp_path):
    from tests.conftest import save_tiny_model, tiny_hf_config

    target = tiny_model_dir("llama")
    prompts = _prompts(4)
    me = _llm(target, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3})
    assert _tokens(me, prompts, GREEDY) == reference("llama", prompts)
    stats = me.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 50 and stats.acceptance_rate > 0.95
    # Requests near their max_tokens want fewer drafts than the others of their step (the draft's one-token
    # steps carry them as padding rows).
    varied = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 17, 8, 26)]
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    assert _tokens(me, prompts, varied) == reference("llama", prompts, varied)
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert drafted > 20 and accepted > 0.95 * drafted  # (a padding row writing into a real block spoils drafts)
    other = save_tiny_model(str(tmp_path / "other"), tiny_hf_config("llama"), seed=1)
    for async_scheduling in (False, True):
        llm = _llm(target, async_scheduling=async_scheduling,
                   speculative_config={"method": "draft_model", "model": other, "num_speculative_tokens": 3})
        assert _tokens(llm, prompts, GREEDY) == reference("llama", prompts)
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_draft_tokens > 50 and stats.acceptance_rate < 0.3


def test_bad_configs_fail_at_start(tiny_model_dir, tmp_path):
    from tests.conftest import save_tiny_model, tiny_hf_config

    target = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="method"):
        _llm(target, speculative_config={"method": "lookahead", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=">= 1"):
        _llm(target, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="needs 'model'"):
        _llm(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="cannot be loaded|does not exist"):
        _llm(target, speculative_config={"method": "draft_model", "model": str(tmp_path / "missing"),
                                         "num_speculative_tokens": 2})
    cfg = tiny_hf_config("llama")
    cfg.vocab_size = 600
    other = save_tiny_model(str(tmp_path / "vocab600"), cfg)
    with pytest.raises(ValueError, match="vocabulary"):
        _llm(target, speculative_config={"method": "draft_model", "model": other, "num_speculative_tokens": 2})


def test_smollm2_ngram_and_self_draft(smollm2_gguf_path):
    text = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank. "
            "The quick brown fox jumps over")
    params = SamplingParams(temperature=0.0, max_tokens=16)
    common = dict(max_model_len=512, kv_cache_memory_bytes=1 << 26)
    ngram = LLM(smollm2_gguf_path, speculative_config=NGRAM, **common)
    ngram.engine.scheduler.spec.k = 0  # speculation off in the same engine: the plain reference
    plain = ngram.generate([text], params, use_tqdm=False)[0].outputs[0].token_ids
    assert ngram.engine.scheduler.spec_stats.num_drafts == 0
    ngram.engine.scheduler.spec.k = NGRAM["num_speculative_tokens"]
    assert ngram.generate([text], params, use_tqdm=False)[0].outputs[0].token_ids == plain
    assert ngram.engine.scheduler.spec_stats.num_accepted_tokens > 0
    del ngram
    draft = LLM(smollm2_gguf_path, **common, speculative_config={
        "method": "draft_model", "model": smollm2_gguf_path, "num_speculative_tokens": 4})
    assert draft.generate([text], params, use_tqdm=False)[0].outputs[0].token_ids == plain
    stats = draft.engine.scheduler.spec_stats
    assert stats.num_draft_tokens >= 8 and stats.acceptance_rate > 0.9
    # the draft .gguf on the CPU keeps its quantized blocks (the weights of every layer), as the target does
    def packed(model):
        return sum(m.__dict__.get("gguf_numel", 0) for m in model.modules())
    assert packed(draft.engine.worker.runner.spec.proposer.model) == packed(draft.engine.worker.model) > 10 ** 8



def test_smollm2_stop_string_inside_accepted_drafts_ends_token_ids(smollm2_gguf_path):
    """A stop string completed by a token in the middle of a step's accepted drafts: the tokens after that one are
    not output (token_ids, logprobs and cumulative logprob as without speculation); they were kept."""
    text = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat"
    params = [SamplingParams(temperature=0.0, max_tokens=30, stop=[" the"], logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=30, stop=["mat"], include_stop_str_in_output=True)]
    llm = LLM(smollm2_gguf_path, speculative_config=NGRAM, dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=1 << 24)

    def run():
        return [(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
                for o in llm.generate([text, text], params, use_tqdm=False) for c in o.outputs]

    llm.engine.scheduler.spec.k = 0  # speculation off in the same engine: the plain reference
    plain = run()
    llm.engine.scheduler.spec.k = NGRAM["num_speculative_tokens"]
    spec = run()
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert [s[:4] for s in spec] == [p[:4] for p in plain]
    assert plain[0][0] == " sat on" and len(plain[0][1]) == len(plain[0][5]) == 3
    assert len(spec[0][5]) == 3 and spec[0][4] == pytest.approx(plain[0][4], abs=1e-3)

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_strings_and_stop_tokens_mid_draft(tiny_model_dir, async_scheduling):
    """Several tokens arrive per step: a stop string or stop token inside them ends the output at the same place."""
    model = tiny_model_dir("llama")
    prompts = _prompts(5)[:2]
    plain, spec = _llm(model), _llm(model, speculative_config=NGRAM, async_scheduling=async_scheduling)
    free = plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for out, prompt in zip(free, prompts):
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        stop_text = text[len(text) // 2:len(text) // 2 + 3]
        for params in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop_text]),
                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[ids[25]])):
            a = plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
            b = spec.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
            assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, b.finish_reason,
                                                                            b.stop_reason)
            assert a.finish_reason == "stop"


def test_overlapped_and_host_drafted_steps_in_one_run(tiny_model_dir, reference, monkeypatch):
    """Async scheduling: while a request whose sampling needs every earlier token (a seed) runs, speculating steps
    wait for the previous one and verify host drafts; once it is done they overlap again (device drafts). The
    greedy requests' tokens are the same throughout, and the switch is not a choice of the test:
    PAGEDLLM_SPEC_OVERLAP=0 keeps the host drafts for the whole run."""
    prompts = _prompts(6)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    params = [GREEDY] * len(prompts) + [seeded]
    model = tiny_model_dir("llama")
    for overlap in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_SPEC_OVERLAP", overlap)
        llm = _llm(model, speculative_config=NGRAM, async_scheduling=True, block_size=8)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts + [prompts[0]]], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs[:-1]] == reference("llama", prompts)
        assert len(outs[-1].outputs[0].token_ids) == 6
        device = llm.engine.worker.runner.spec.device_ngram
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_accepted_tokens > 0
        if overlap == "1":
            assert device is not None and device.num_overlapped_steps > 0
        else:
            assert device is None


def test_abort_while_an_overlapped_verify_step_is_in_flight(tiny_model_dir, reference):
    """A request aborted while its verify step runs: its row goes to a new request (a chunked prefill) before that
    step's result is read; the late result must not touch the new request's tokens, on the host or the device."""
    from pagedllm.core.engine_core import EngineCoreRequest

    model = tiny_model_dir("llama")
    prompts = _prompts(7)
    llm = _llm(model, speculative_config=NGRAM, async_scheduling=True, block_size=8, max_num_batched_tokens=16,
               max_num_seqs=1)
    engine = llm.engine
    engine.add_request(EngineCoreRequest("a", prompts[0], GREEDY))
    in_flight_verify = False
    for _ in range(60):
        engine.step()
        plan = engine._in_flight[0] if engine._in_flight is not None else None
        if plan is not None and plan.scheduled_spec_decode_tokens and plan.spec_overlap:
            in_flight_verify = True
            break
    assert in_flight_verify
    engine.abort_requests(["a"])
    engine.add_request(EngineCoreRequest("b", prompts[1], GREEDY))
    tokens = []
    for _ in range(200):
        for out in engine.step():
            if out.request_id == "b":
                tokens += out.new_token_ids
        if not engine.scheduler.has_unfinished_requests() and engine._in_flight is None:
            break
    assert tokens == reference("llama", [prompts[1]])[0]


def test_overlapped_ngram_sampling_keeps_the_target_distribution(tiny_model_dir, tmp_path):
    """Temperature 1, unseeded (the steps overlap: device drafts, padded where the lookup finds fewer than k), 2400
    requests on a peaked model: every emitted token fits the distribution the engine reports for it
    (spec_checks.check_overlapped_sampling). Accepting every draft fails it by ~30 standard deviations; resampling a
    rejected row from p with its draft left in, by ~5 (each simulated on this engine)."""
    from tests.gpu.spec_checks import check_overlapped_sampling, peaked_model

    model = peaked_model(tiny_model_dir("llama"), str(tmp_path / "peaked"))
    llm = _llm(model, async_scheduling=True, max_num_seqs=128, kv_cache_memory_bytes=1 << 26, max_model_len=512,
               speculative_config=dict(NGRAM, disable_by_batch_size=None))
    check_overlapped_sampling(llm, _prompts(8)[2][:12])


@pytest.mark.parametrize("disable_log_stats", [True, False])
def test_acceptance_log_follows_disable_log_stats(tiny_model_dir, caplog, disable_log_stats):
    """The periodic acceptance line is a stats log: off with disable_log_stats (the offline default, as vLLM's LLM),
    on without it (`serve` unless --disable-log-stats); the start-up line says which."""
    import logging

    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = _llm(tiny_model_dir("llama"), speculative_config=NGRAM, disable_log_stats=disable_log_stats)
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Speculative decoding:")]
    assert len(started) == 1
    assert ("acceptance is logged every" in started[0]) is not disable_log_stats
    assert (llm.engine._spec_log is None) is disable_log_stats


def test_serve_passes_disable_log_stats_to_the_engine():
    import argparse

    from pagedllm.entrypoints.openai.cli_args import add_serve_args, to_engine_args

    parser = add_serve_args(argparse.ArgumentParser(), positional_model=False)
    assert to_engine_args(parser.parse_args([])).disable_log_stats is False
    assert to_engine_args(parser.parse_args(["--disable-log-stats"])).disable_log_stats is True


def test_longrope_draft_model_rotates_as_the_target(tiny_model_dir, reference):
    """Phi-3 LongRoPE (original context 32): requests past it run with the long factors on the target; a draft of the
    target itself must rotate them so too (it used the short factors for every token: ~16% of drafts rejected)."""
    target = tiny_model_dir("phi3")
    prompts = [p[:n] for p, n in zip(_prompts(9), (20, 40, 60, 10))]
    me = _llm(target, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 4})
    assert _tokens(me, prompts, GREEDY) == reference("phi3", prompts)
    stats = me.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 50 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_dynamic_ntk_draft_model_rotates_long_prompts_as_the_target(tiny_model_dir):
    """Dynamic NTK (context 512): a longer prompt's tokens are rotated with the base for its length on the target; a
    draft of the target itself must do the same (it rotated them plainly: its drafts for that prompt were rejected)."""
    ntk = {"rope_type": "dynamic", "factor": 2.0}
    target = tiny_model_dir("llama", rope_scaling=ntk)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in (600, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 4}
    me = _llm(target, speculative_config=spec, max_model_len=1024)
    assert _tokens(me, prompts, params) == _tokens(_llm(target, max_model_len=1024), prompts, params)
    stats = me.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens == stats.num_draft_tokens
