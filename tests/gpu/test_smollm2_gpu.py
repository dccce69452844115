"""The real default model (SmolLM2-135M-Instruct GGUF) on CUDA in float32: CUDA graphs, Triton attention and GPU
sampling give transformers' greedy tokens exactly, and the chat answer names Paris."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_smollm2 import check_greedy_matches_transformers

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def llm(smollm2_hf_dir):
    """A fresh engine per test: one shared by the module would carry the first test's prefix-cache blocks into
    the second (other kernels, other results: an order dependence)."""
    llm = LLM(model=smollm2_hf_dir, dtype="float32", device="cuda", num_gpu_blocks_override=512)
    assert llm.engine.worker.runner.cuda_graphs is not None
    yield llm
    del llm  # freed before the next test (tests/conftest.py collects)


def test_smollm2_fp32_greedy_matches_transformers_on_gpu(llm, smollm2_hf_dir):
    check_greedy_matches_transformers(llm, smollm2_hf_dir)


def test_smollm2_answers_paris_on_gpu(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
