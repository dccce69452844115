"""The real default model (SmolLM2-135M-Instruct GGUF) through the engine, compared with transformers."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

from tests.engine.test_correctness import hf_greedy


@pytest.fixture(scope="module")
def llm(smollm2_hf_dir):
    return LLM(model=smollm2_hf_dir, dtype="float32", num_gpu_blocks_override=256)


def test_capital_of_france(llm):
    outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    assert outs[0].outputs[0].finish_reason in ("stop", "length")


def test_default_model_loads_without_arguments(smollm2_cache_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", smollm2_cache_dir)
    default = LLM(num_gpu_blocks_override=64)
    assert default.engine.worker.hf_config.architectures == ["LlamaForCausalLM"]
    out = default.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out[0].outputs[0].text


def test_greedy_tokens_match_transformers_in_a_mixed_batch(llm, smollm2_hf_dir):
    check_greedy_matches_transformers(llm, smollm2_hf_dir)


def check_greedy_matches_transformers(llm, smollm2_hf_dir):
    """Four real prompts in one batch: transformers' greedy tokens exactly, logprobs within 1e-3 (fp32)."""
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):",
             "Write a haiku about the sea.\nThe sea",
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


def test_stop_strings_n_and_seeds(llm):
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, n=3, seed=7)
    a = llm.generate("Tell me about the ocean.", sp, use_tqdm=False)[0]
    b = llm.generate(["Hi there", "Tell me about the ocean."], sp, use_tqdm=False)[1]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]  # seeded: batch-independent
    assert len(a.outputs) == 3 and [o.index for o in a.outputs] == [0, 1, 2]
    stop = llm.generate("Count: one, two, three, four,", SamplingParams(temperature=0, max_tokens=30, stop=[","]),
                        use_tqdm=False)[0].outputs[0]
    assert "," not in stop.text and stop.finish_reason == "stop" and stop.stop_reason == ","
