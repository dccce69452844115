"""The real default model (SmolLM2-135M-Instruct GGUF) on CUDA in float32: CUDA graphs, Triton attention and GPU
sampling give transformers' greedy tokens exactly, and the chat answer names Paris."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_correctness import hf_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def llm(smollm2_hf_dir):
    llm = LLM(model=smollm2_hf_dir, dtype="float32", device="cuda", num_gpu_blocks_override=512)
    assert llm.engine.worker.runner.cuda_graphs is not None
    return llm


def test_smollm2_fp32_greedy_matches_transformers_on_gpu(llm, smollm2_hf_dir):
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.\nThe sea",
             "Once upon a time, in a small village at the edge of a great forest, there lived an old"]
    prompts = [tok.encode(t) for t in texts]
    max_tokens = [12, 20, 8, 16]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, m, out in zip(prompts, max_tokens, outs):
        ref_tokens, ref_lps = hf_greedy(smollm2_hf_dir, p, m)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens
        lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-3, rtol=0)


def test_smollm2_answers_paris_on_gpu(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
