"""A sequence classifier under tensor and pipeline parallelism (gloo worker processes on the CPU): the replicated
score head on the last stage gives transformers' label logits (fp32, the same weights) through chunked prompts."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from tests.engine.test_classify import hf_logits
from tests.engine.test_correctness import random_prompts

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_classifier_matches_hf(tiny_classifier_dir, tp, pp):
    model_dir = tiny_classifier_dir("qwen3")
    llm = LLM(model_dir, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=4,
              max_num_batched_tokens=16, num_gpu_blocks_override=48, block_size=8, max_model_len=128,
              tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        prompts = random_prompts([29, 5, 17], seed=43)
        outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            want = hf_logits(model_dir, prompt).softmax(-1)
            torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=2e-5, rtol=1e-4)
    finally:
        llm.engine.shutdown()
