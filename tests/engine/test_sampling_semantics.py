"""QA sweep of SamplingParams semantics through the real engine (tiny random llama): options that edit the logits
give the same tokens with speculative decoding as without, seeds and n behave as vLLM's."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

from tests.engine.test_spec_decode import NGRAM, _prompts


def _llm(model, **kw):
    return LLM(model, kv_cache_memory_bytes=1 << 24, max_model_len=256, **kw)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    d = tiny_model_dir("llama")
    return _llm(d), _llm(d, speculative_config=NGRAM)


def _outs(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


CONSTRAINED = [
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logit_bias={5: 3.0, 9: -100.0}),
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, allowed_token_ids=list(range(100, 400))),
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, min_tokens=20, stop_token_ids=[7, 8, 9]),
]


@pytest.mark.parametrize("params", CONSTRAINED, ids=["presence", "logit_bias", "allowed", "min_tokens_stop_ids"])
def test_spec_decode_keeps_constraints(engines, params):
    plain, spec = engines
    prompts = _prompts()
    a, b = _outs(plain, prompts, params), _outs(spec, prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_spec_decode_bad_words_token_ids(engines):
    """A two-token bad word (ids) the greedy output contains is never completed, with and without drafts."""
    plain, spec = engines
    prompts = _prompts()
    free = _outs(plain, prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    ids = free[0].token_ids
    bad = [ids[3], ids[4]]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    params.bad_words_token_ids = [bad]
    a, b = _outs(plain, prompts, params), _outs(spec, prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for o in a:
        assert all(o.token_ids[i:i + 2] != bad for i in range(len(o.token_ids) - 1))


def test_seeded_request_without_drafts_ignores_the_batchs_drafts(engines):
    """A seeded request that gets no drafts samples the tokens it gets without speculative decoding, whether or
    not its batch-mates verify drafts in the same step (its seeded generator's first draw is its sample; the
    acceptance test used to take it, so a draft elsewhere in the batch changed this request's tokens)."""
    plain, spec = engines
    prompts = _prompts()  # the third's n-gram lookups hit from its first decode step, the first's not yet
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=6, ignore_eos=True)
    lone = _outs(plain, prompts[:1], params)[0].token_ids
    assert _outs(spec, prompts[:1], params)[0].token_ids == lone  # (no drafts: the plain sampler's path)
    assert _outs(spec, prompts, params)[0].token_ids == lone


@pytest.mark.parametrize("use_spec", [False, True], ids=["plain", "ngram"])
def test_sampled_logprobs_with_n_are_transformers_raw_log_softmax(engines, tiny_model_dir, use_spec):
    """n=2 random samples with temperature / top-k / top-p, drafts verified or not: each position's logprobs are the
    raw (unprocessed) fp32 log-softmax, as vLLM's default logprobs_mode, with the sampled token and its rank."""
    import torch

    from tests.engine.test_correctness import _hf_model

    llm = engines[1] if use_spec else engines[0]
    prompt = _prompts()[1]
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.9, n=2, seed=3, max_tokens=8, ignore_eos=True,
                            logprobs=3)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    hf = _hf_model(tiny_model_dir("llama"))
    for c in out.outputs:
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt + c.token_ids])).logits[0].float(), -1)
        assert len(c.logprobs) == len(c.token_ids) == 8
        for j, (t, pos) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert t in pos and set(row.topk(3).indices.tolist()) <= set(pos)
            for tid, lp in pos.items():
                assert abs(lp.logprob - float(row[tid])) < 1e-4
                assert lp.rank == int((row > row[tid]).sum()) + 1
