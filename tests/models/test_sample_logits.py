"""`sample_logits`: the logits a random-sampling step draws from in the LM head's own dtype (the device sampler reads
them as they are; worker/model_runner.py): the values of compute_logits exactly, or None where compute_logits does
more than the LM head (Gemma 2's final soft-capping), which the runner then calls instead."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "phi3"])
def test_sample_logits_are_compute_logits_in_the_model_dtype(tiny_model_dir, arch):
    llm = LLM(model=tiny_model_dir(arch), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64,
              enforce_eager=True)
    model = llm.engine.worker.runner.model
    hidden = torch.randn(5, model.lm_head.embedding_dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    raw = model.sample_logits(hidden)
    assert raw is not None and raw.dtype == torch.bfloat16
    assert torch.equal(raw.float(), model.compute_logits(hidden))


def test_sample_logits_none_where_compute_logits_soft_caps(tiny_model_dir):
    llm = LLM(model=tiny_model_dir("gemma2"), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64,
              enforce_eager=True)
    model = llm.engine.worker.runner.model
    assert model.final_logit_softcap is not None  # (the tiny config keeps Gemma 2's cap)
    assert model.sample_logits(torch.zeros(1, model.lm_head.embedding_dim, dtype=torch.bfloat16)) is None
