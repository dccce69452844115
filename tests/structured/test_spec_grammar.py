"""Structured outputs on an engine with speculative decoding (n-gram, and SmolLM2 drafting for itself): greedy
JSON-schema / regex / choice outputs are token for token those of the same engine without speculation, batched
with unconstrained requests that keep speculating (the engine's spec counters grow); the grammar requests' own
drafts are verified too. Below the engine: drafts are cut at the first token the grammar rejects, the verify rows'
masks are the grammar's after each draft, and the matcher is left where it was."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.structured_output import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}
REGEX = r"[a-c]{2}-[0-9]{3}"
CHOICES = ["red", "green", "blue"]
RECORD = '{"name": "fox", "age": 7}'
# Repetitive prompts, so that n-gram lookup finds drafts (also for the grammar requests: the answer is in the prompt)
PROMPTS = [f"Repeat this JSON exactly: {RECORD}\nRepeat this JSON exactly: {RECORD}\nAnswer: ",
           "Code: ab-123 ab-123 ab-123. The code is ",
           "Pick a color among red, green, blue. red green blue. Answer: ",
           "Repeat: one two three four five six seven eight nine ten one two three four five six seven eight nine ten "
           "one two",
           "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown"]
GREEDY = dict(temperature=0.0, max_tokens=40)
PARAMS = [SamplingParams(**GREEDY, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
          SamplingParams(**GREEDY, structured_outputs=StructuredOutputsParams(regex=REGEX)),
          SamplingParams(**GREEDY, structured_outputs=StructuredOutputsParams(choice=CHOICES)),
          SamplingParams(**GREEDY), SamplingParams(**GREEDY)]
COMMON = dict(max_model_len=512, kv_cache_memory_bytes=1 << 26)


def _run(llm: LLM, prompts=PROMPTS, params=PARAMS) -> list[tuple[str, list[int], str]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def _check_grammars(outs) -> None:
    json.loads(outs[0][0])
    assert set(json.loads(outs[0][0])) == {"name", "age"}
    assert re.fullmatch(REGEX, outs[1][0]), outs[1][0]
    assert outs[2][0] in CHOICES
    assert [o[2] for o in outs[:3]] == ["stop"] * 3


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def ngram_llm(request, smollm2_gguf_path):
    """async: the CPU runs overlapped n-gram speculation's device-side path (spec_decode/device_ngram.py)."""
    llm = LLM(smollm2_gguf_path, speculative_config=NGRAM, async_scheduling=request.param, **COMMON)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def plain_outputs(ngram_llm):
    """The same engine with speculation off (k = 0): the reference."""
    spec = ngram_llm.engine.scheduler.spec
    drafts = spec.stats.num_drafts
    spec.k = 0
    try:
        outs = _run(ngram_llm)
    finally:
        spec.k = NGRAM["num_speculative_tokens"]
    assert spec.stats.num_drafts == drafts
    _check_grammars(outs)
    return outs


def test_ngram_grammar_outputs_identical_in_a_speculating_batch(ngram_llm, plain_outputs):
    stats = ngram_llm.engine.scheduler.spec_stats
    before = stats.num_accepted_tokens
    assert _run(ngram_llm) == plain_outputs
    assert stats.num_accepted_tokens > before  # the unconstrained requests speculated


def test_ngram_grammar_alone_and_repeated(ngram_llm, plain_outputs):
    """Grammar requests without unconstrained company (their own drafts are verified and accepted), and the batch
    twice over (prefix hits, more rows)."""
    stats = ngram_llm.engine.scheduler.spec_stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    assert _run(ngram_llm, PROMPTS[:3], PARAMS[:3]) == plain_outputs[:3]
    assert stats.num_draft_tokens > drafted and stats.num_accepted_tokens > accepted
    assert _run(ngram_llm, PROMPTS * 2, PARAMS * 2) == plain_outputs * 2


def test_grammar_rows_through_the_rejection_sampler(ngram_llm):
    """Rows that are not plain greedy (logprobs, top-k 1 sampling, penalties) take the rejection sampler's path,
    with the grammar's masks in its metadata: the same tokens as without speculation, and seeded random sampling
    under a grammar stays inside it."""
    so = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
          StructuredOutputsParams(choice=CHOICES)]
    params = [SamplingParams(**GREEDY, logprobs=1, structured_outputs=so[0]),
              SamplingParams(temperature=0.8, top_k=1, max_tokens=40, structured_outputs=so[1]),
              SamplingParams(**GREEDY, repetition_penalty=1.2, structured_outputs=so[2]),
              SamplingParams(**GREEDY, logprobs=1)]
    spec = ngram_llm.engine.scheduler.spec
    spec.k = 0
    try:
        plain = _run(ngram_llm, PROMPTS[:4], params)
    finally:
        spec.k = NGRAM["num_speculative_tokens"]
    stats = ngram_llm.engine.scheduler.spec_stats
    accepted = stats.num_accepted_tokens
    assert _run(ngram_llm, PROMPTS[:4], params) == plain
    assert stats.num_accepted_tokens > accepted
    so[0] = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)  # (bounded: no free whitespace)
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=so[s]) for s in range(3)]
    _check_grammars(_run(ngram_llm, PROMPTS[:3], sampled))


def test_guidance_backend_grammar_outputs_identical(smollm2_gguf_path, ngram_llm):
    """llguidance's matcher stops as soon as only its stop token can follow, and records no token it takes after
    that: the drafts' checks and rollbacks must count as xgrammar's do."""
    if ngram_llm.engine.async_scheduling:
        pytest.skip("one guidance engine is enough")
    llm = LLM(smollm2_gguf_path, speculative_config=NGRAM, structured_outputs_config={"backend": "guidance"},
              **COMMON)
    try:
        spec = llm.engine.scheduler.spec
        spec.k = 0
        plain = _run(llm, PROMPTS[:3], PARAMS[:3])
        _check_grammars(plain)
        spec.k = NGRAM["num_speculative_tokens"]
        assert _run(llm, PROMPTS[:3], PARAMS[:3]) == plain
        assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    finally:
        llm.shutdown()


def test_self_draft_model_grammar_outputs_identical(smollm2_gguf_path, ngram_llm, plain_outputs):
    if ngram_llm.engine.async_scheduling:
        pytest.skip("one draft-model engine is enough (its verify steps always wait for the step before)")
    draft = LLM(smollm2_gguf_path, **COMMON, speculative_config={
        "method": "draft_model", "model": smollm2_gguf_path, "num_speculative_tokens": 4})
    try:
        assert _run(draft) == plain_outputs
        stats = draft.engine.scheduler.spec_stats
        assert stats.num_accepted_tokens > 0 and stats.acceptance_rate > 0.9
    finally:
        draft.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_draft_cut_and_per_position_masks(tiny_llama_dir, backend):
    from pagedllm.spec_decode.scheduling import grammar_prefix
    from pagedllm.structured_output.manager import StructuredOutputManager
    from pagedllm.tokenizer import get_tokenizer

    tok = get_tokenizer(tiny_llama_dir)
    eos = tok.eos_token_id
    manager = StructuredOutputManager(tiny_llama_dir, len(tok), [eos], config={"backend": backend})
    try:
        so = manager.submit(StructuredOutputsParams(regex=REGEX))
        so.future.result()
        assert so.is_ready()
        ids = [tok.convert_tokens_to_ids(c) for c in "ab-123"]  # one token per character (byte-level BPE)
        assert so.accept(ids[:1])
        start = manager.bitmask([so])
        # cut at the first rejected draft ("x"), the matcher rolled back to where it was
        x = tok.convert_tokens_to_ids("x")
        assert grammar_prefix(so, ids[1:4] + [x] + ids[4:]) == ids[1:4]
        assert (manager.bitmask([so]) == start).all()
        # nothing after the draft that ends the grammar
        assert grammar_prefix(so, ids[1:] + [eos, ids[0]]) == ids[1:] + [eos]
        # one mask per verify position: the grammar's after each draft; once it ended (llguidance: as soon as only
        # its stop token can follow; xgrammar: once that was taken) all ones, the request stopping there
        drafts = ids[1:] + [eos]
        rows = manager.bitmask([so, so], [drafts, []])
        assert rows.shape[0] == 1 + len(drafts) + 1
        expected = [start[0]]
        for token in drafts:
            assert so.accept([token])
            expected.append(np.full_like(start[0], -1) if so.is_terminated() else manager.bitmask([so])[0])
        so.rollback(len(drafts))
        assert (rows[:len(expected)] == np.stack(expected)).all()
        assert (rows[-1] == start[0]).all() and (manager.bitmask([so]) == start).all()
    finally:
        manager.shutdown()
