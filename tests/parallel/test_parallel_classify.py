"""A sequence classifier under tensor and pipeline parallelism (gloo worker processes on the CPU): the replicated
score head on the last stage gives transformers' label logits (fp32, the same weights) through chunked prompts, of
the last token and of every token; a process reward model's two-layer head likewise, STEP-pooled."""
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
        # every token's logits (token_classify) through the same head, the chunks' rows gathered on the last stage
        from pagedllm.pooling import PoolingParams
        from tests.engine.test_classify import hf_classifier

        hf = hf_classifier(model_dir)
        (tokens,) = llm.encode({"prompt_token_ids": prompts[0]}, PoolingParams(use_activation=False),
                               use_tqdm=False, pooling_task="token_classify")
        with torch.inference_mode():
            want = hf.score(hf.model(torch.tensor([prompts[0]])).last_hidden_state[0])
        torch.testing.assert_close(tokens.outputs.data, want, atol=1e-4, rtol=1e-4)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_process_reward_model(tiny_reward_dir, tp, pp):
    """Qwen2ForProcessRewardModel's two-layer head, replicated on the last stage, under TP / PP: STEP rows of the
    step-tag tokens as the reference gives them (transformers' Qwen2Model plus the head in torch)."""
    from pagedllm.pooling import PoolingParams
    from tests.engine.test_reward_models import TAG, reference_logits, tagged_prompts

    model_dir = tiny_reward_dir("Qwen2ForProcessRewardModel")
    llm = LLM(model_dir, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=4,
              max_num_batched_tokens=16, num_gpu_blocks_override=48, block_size=8, max_model_len=128,
              tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        prompts = tagged_prompts([27, 8], seed=17)
        outs = llm.reward([{"prompt_token_ids": p} for p in prompts], pooling_params=PoolingParams(step_tag_id=TAG),
                          use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            mask = torch.tensor([t == TAG for t in prompt])
            want = reference_logits(model_dir, prompt)[mask].softmax(-1)
            torch.testing.assert_close(out.outputs.data, want, atol=2e-5, rtol=1e-4)
    finally:
        llm.engine.shutdown()
