"""enable_prompt_embeds on CUDA: steps that carry prompt embeddings run eagerly, the decode steps after them replay
CUDA graphs, and token prompts in the same batch are untouched. Greedy tokens (fp32) are transformers'
generate(inputs_embeds) with the same weights, as on the CPU (tests/engine/test_prompt_embeds.py)."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_prompt_embeds import _embeds, hf_generate_from_embeds

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_embeds_on_cuda_graphs_match_transformers(tiny_llama_dir, async_scheduling):
    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cuda", enable_prompt_embeds=True,
              async_scheduling=async_scheduling, num_gpu_blocks_override=128, max_model_len=256,
              gpu_memory_utilization=0.3)
    try:
        runner = llm.engine.worker.runner
        hidden = llm.engine.hidden_size
        token_prompt = [5, 6, 7, 8, 9]
        alone = llm.generate([token_prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert runner.cuda_graphs is not None  # decode graphs captured: the steps after the prefill replay them
        embeds = [_embeds(n, hidden, seed) for seed, n in enumerate((5, 19, 40), start=11)]
        prompts = [{"prompt_embeds": embeds[0]}, token_prompt, {"prompt_embeds": embeds[1].cuda()},
                   {"prompt_embeds": embeds[2].to(torch.bfloat16)}]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert outs[1].outputs[0].token_ids == alone
        for i, e in ((0, embeds[0]), (2, embeds[1]), (3, embeds[2].to(torch.bfloat16).float())):
            assert outs[i].outputs[0].token_ids == hf_generate_from_embeds(tiny_llama_dir, e, 8), i
        # the same embeddings again hit their own prefix blocks; tokens unchanged
        again = llm.generate({"prompt_embeds": embeds[2].to(torch.bfloat16)}, GREEDY, use_tqdm=False)[0]
        assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == outs[3].outputs[0].token_ids
    finally:
        llm.shutdown()
