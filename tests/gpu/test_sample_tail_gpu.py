"""Sampled tails on CUDA (worker/greedy_tail.py, SampleTails): decode steps whose rows sample with temperature,
top-p and min-p replay the LM head and the device sampler as a graph. A top-p too small to keep more than the most
likely token, or a min-p of 1, makes every draw the argmax: the tokens equal greedy decoding's, while batches
shrink. At temperature 1 the draws have the eager sampler's distribution (two-sample chi-square against the same
engine with PAGEDLLM_GRAPH_SAMPLE=0, on a model whose next-token distributions are peaked), and a step's draw is not
the previous step's (the graph advances the rows' keys)."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from spec_checks import chi2_limit, peaked_model, two_sample_chi2
from tests.engine.test_correctness import random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

COMMON = dict(device="cuda", num_gpu_blocks_override=512, max_num_seqs=8)


def _engine(model_dir, monkeypatch, on: bool, **kwargs):
    monkeypatch.setenv("PAGEDLLM_GRAPH_SAMPLE", "1" if on else "0")
    return LLM(model_dir, **COMMON, **kwargs)


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_argmax_draws_equal_greedy(tiny_llama_dir, monkeypatch):
    llm = _engine(tiny_llama_dir, monkeypatch, True, dtype="float32")
    tails = llm.engine.worker.runner.cuda_graphs.sample_tails
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 30, 11, 50, 7, 1, 19, 2, 44], seed=31)]
    lens = [6 + 5 * i for i in range(len(prompts))]
    greedy = _tokens(llm, prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens])
    for extra in (dict(top_p=1e-9), dict(min_p=1.0), dict(top_p=1e-9, min_p=0.5)):
        before = tails.num_replays
        got = _tokens(llm, prompts, [SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True, **extra)
                                     for n in lens])
        assert got == greedy, extra
        assert tails.num_replays - before >= 40, extra  # the longest request's decode steps at least
    names = {gkey[1] for gkey, graph in tails.graphs.items() if graph is not None}
    assert {("temperature", "top_p"), ("temperature", "min_p"), ("temperature", "top_p", "min_p")} <= names


def test_draws_have_the_eager_samplers_distribution(tiny_llama_dir, monkeypatch, tmp_path):
    model = peaked_model(tiny_llama_dir, str(tmp_path / "peaked"))
    prompt = {"prompt_token_ids": random_prompts([12], seed=32)[0]}
    samples = {}
    for on in (True, False):
        llm = _engine(model, monkeypatch, on, dtype="bfloat16")
        for extra in ({}, dict(top_p=0.8)):
            params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, **extra)
            # eight at a time: after their prefill, every step is a pure decode step of eight rows (a tail's)
            outs = [t for _ in range(100) for t in _tokens(llm, [prompt] * 8, params)]
            # the decode steps' tokens (the first comes from the prefill), by position
            samples[(on, tuple(extra))] = [(j, t[j]) for t in outs for j in (1, 2, 3)]
        tails = llm.engine.worker.runner.cuda_graphs.sample_tails
        assert (tails.num_replays >= 2 * 100 * 3) == on
        del llm
        torch.cuda.empty_cache()
    for extra in ((), ("top_p",)):
        a, b = samples[(True, extra)], samples[(False, extra)]
        stat, dof = two_sample_chi2(a, b)
        assert dof > 5 and stat < chi2_limit(dof), (extra, stat, dof)


def test_consecutive_draws_differ(tiny_llama_dir, monkeypatch):
    """The graph's keys advance: the same prompt sampled twice at temperature 1 on a near-flat model (the tiny
    random Llama) gives two different continuations."""
    llm = _engine(tiny_llama_dir, monkeypatch, True, dtype="bfloat16")
    prompt = {"prompt_token_ids": random_prompts([9], seed=33)[0]}
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    first, second = _tokens(llm, [prompt], params)[0], _tokens(llm, [prompt], params)[0]
    assert first[1:] != second[1:]
    assert len(set(first[1:])) > 3
