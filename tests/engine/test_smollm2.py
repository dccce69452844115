"""The real default model (SmolLM2-135M-Instruct GGUF) through the engine, compared with transformers."""
from __future__ import annotations

import re

import pytest
import torch

from pagedllm import LLM, SamplingParams

from tests.engine.test_correctness import hf_greedy


@pytest.fixture(scope="module")
def llm(smollm2_hf_dir):
    return LLM(model=smollm2_hf_dir, dtype="float32", num_gpu_blocks_override=256, max_model_len=4096)


def test_capital_of_france(llm):
    outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    assert outs[0].outputs[0].finish_reason in ("stop", "length")


def test_default_model_loads_without_arguments(smollm2_cache_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", smollm2_cache_dir)
    default = LLM(num_gpu_blocks_override=64, max_model_len=1024)
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


@pytest.mark.parametrize("messages, fragment", [
    ("hello", "a list of message dicts"),
    ({"role": "user", "content": "hi"}, "a list of message dicts"),
    ([["user", "hi"]], "a message is a dict"),
    ([{"content": "x"}], "'role' must be a string"),
    ([{"role": "user", "content": 5}], "'content' must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only 'text' parts"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": "f"}]}],
     "must be an object"),
])
def test_chat_refuses_malformed_messages(llm, messages, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)


def test_chat_text_parts_and_template_errors(llm):
    """Text parts are joined as the server joins them (the same tokens as a string); a broken template is a
    ValueError naming it."""
    params = SamplingParams(temperature=0.0, max_tokens=4)
    plain = llm.chat([{"role": "user", "content": "Hi there"}], params, use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}], params,
                     use_tqdm=False)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids and parts.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="Could not apply the chat template"):
        llm.chat([{"role": "user", "content": "x"}], params, chat_template="{% for %}", use_tqdm=False)


@pytest.mark.parametrize("prompt, error, fragment", [
    ({"prompt_token_ids": [-1]}, ValueError, "integers in [0, "),
    ({"prompt_token_ids": ["a"]}, ValueError, "integers in [0, "),
    ({"prompt_token_ids": [True, 2]}, ValueError, "integers in [0, "),
    ({"prompt_token_ids": None}, ValueError, "must be a list of token ids"),
    ({"prompt": "a", "multi_modal_data": {}}, ValueError, "not supported"),
])
def test_generate_refuses_bad_prompt_ids_before_queuing(llm, prompt, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("params, fragment", [({"max_tokens": 4}, "got dict"), ("greedy", "got str"),
                                              ([None], "sampling_params[0] must be a SamplingParams")])
def test_generate_refuses_what_is_not_sampling_params(llm, params, fragment):
    with pytest.raises(TypeError, match=re.escape(fragment)):
        llm.generate("Hi", params, use_tqdm=False)


def test_prompt_token_ids_as_numpy(llm):
    import numpy as np

    params = SamplingParams(temperature=0.0, max_tokens=3)
    a = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate({"prompt_token_ids": np.array([1, 2, 3])}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
