"""Structured outputs with speculative decoding on CUDA (fp32, SmolLM2: carry both GGUF pieces): greedy JSON-schema /
regex / choice outputs batched with speculating unconstrained requests are token for token those of the same engine
with speculation off, with async scheduling off and on (the overlapped device-side n-gram path) and with a draft
model. The CPU twin is tests/structured/test_spec_grammar.py, whose prompts and checks this reuses."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from tests.structured.test_spec_grammar import NGRAM, PARAMS, PROMPTS, _check_grammars, _run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

COMMON = dict(max_model_len=512, dtype="float32", device="cuda", num_gpu_blocks_override=256,
              gpu_memory_utilization=0.3)


def _plain_and_spec(llm: LLM, prompts=PROMPTS, params=PARAMS):
    spec = llm.engine.scheduler.spec
    spec.k = 0
    try:
        plain = _run(llm, prompts, params)
    finally:
        spec.k = NGRAM["num_speculative_tokens"]
    stats = llm.engine.scheduler.spec_stats
    accepted = stats.num_accepted_tokens
    got = _run(llm, prompts, params)
    return plain, got, stats.num_accepted_tokens - accepted


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ngram_grammar_outputs_on_cuda_equal_no_speculation(smollm2_gguf_path, async_scheduling):
    llm = LLM(smollm2_gguf_path, speculative_config=NGRAM, async_scheduling=async_scheduling, **COMMON)
    try:
        assert llm.engine.worker.runner.mixed_graphs is not None  # verify steps replay graphs
        plain, got, accepted = _plain_and_spec(llm)
        _check_grammars(plain)
        assert got == plain and accepted > 0
        alone_plain, alone, alone_accepted = _plain_and_spec(llm, PROMPTS[:3], PARAMS[:3])
        assert alone == alone_plain == plain[:3] and alone_accepted > 0  # the grammar rows' own drafts accepted
    finally:
        llm.shutdown()


def test_draft_model_grammar_outputs_on_cuda_equal_no_speculation(smollm2_gguf_path):
    plain_llm = LLM(smollm2_gguf_path, **COMMON)
    try:
        plain = _run(plain_llm)
    finally:
        plain_llm.shutdown()
    _check_grammars(plain)
    llm = LLM(smollm2_gguf_path, **COMMON, speculative_config={
        "method": "draft_model", "model": smollm2_gguf_path, "num_speculative_tokens": 4})
    try:
        assert _run(llm) == plain
        assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    finally:
        llm.shutdown()
