"""Embeddings from tensor- and pipeline-parallel engines (gloo worker processes on the CPU): the pooled vectors come
from the last stage's hidden states through the output rank, equal to transformers' (fp32, the same weights), with
prompts chunked across steps and generation in the same batches."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.pooling import sampling_params_for
from tests.engine.test_correctness import hf_greedy, random_prompts
from tests.engine.test_embeddings import check_pooled

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_embeddings_match_hf(tiny_llama_dir, tp, pp):
    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=4,
              max_num_batched_tokens=16, num_gpu_blocks_override=48, block_size=8, max_model_len=128,
              tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        prompts = random_prompts([29, 5, 17], seed=41)
        generating = random_prompts([11], seed=42)
        kinds = ["mean", "last", "cls"]
        params = [sampling_params_for(k) for k in kinds] + [SamplingParams(temperature=0, max_tokens=9,
                                                                           ignore_eos=True)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts + generating], params, use_tqdm=False)
        for prompt, kind, out in zip(prompts, kinds, outs):
            check_pooled(tiny_llama_dir, prompt, kind, out.pooled, normalized=False)
        assert outs[-1].outputs[0].token_ids == hf_greedy(tiny_llama_dir, generating[0], 9)[0]
    finally:
        llm.engine.shutdown()
