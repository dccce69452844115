"""Penalties on the real SmolLM2 model against a reference built from the model's own raw logits: repetition
counts prompt + output tokens, presence / frequency only output tokens (vLLM's semantics)."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

PROMPT = "Paris Paris Paris. The capital of France is"  # " Paris" in the prompt: presence must not count it


@pytest.fixture(scope="module")
def engines(smollm2_hf_dir):
    # processed_logits: a greedy row reports its logits after penalties; raw_logits: before them
    kw = dict(model=smollm2_hf_dir, dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
    return LLM(logprobs_mode="processed_logits", **kw), LLM(logprobs_mode="raw_logits", **kw)


@pytest.mark.parametrize("pen", [dict(presence_penalty=1.5), dict(frequency_penalty=1.0),
                                 dict(repetition_penalty=1.7),
                                 dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=0.8)])
def test_penalties_match_reference_from_raw_logits(engines, pen):
    processed, raw = engines
    prompt = processed.get_tokenizer().encode(PROMPT)
    out = processed.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=4, logprobs=20, ignore_eos=True, **pen), use_tqdm=False)[0].outputs[0]
    rep = pen.get("repetition_penalty", 1.0)
    for i in range(len(out.token_ids)):
        done = out.token_ids[:i]
        one = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
        ref = raw.generate({"prompt_token_ids": prompt + done}, one, use_tqdm=False)[0].outputs[0].logprobs[0]
        common = [t for t in out.logprobs[i] if t in ref]
        assert common
        for t in common:
            x = ref[t].logprob
            if t in prompt or t in done:
                x = x / rep if x > 0 else x * rep
            c = done.count(t)
            x -= pen.get("frequency_penalty", 0.0) * c + pen.get("presence_penalty", 0.0) * (c > 0)
            assert out.logprobs[i][t].logprob == pytest.approx(x, abs=1e-4), (i, t)
