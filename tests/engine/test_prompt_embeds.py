"""vLLM's enable_prompt_embeds offline: LLM.generate({"prompt_embeds": tensor[num_tokens, hidden]}). The embeddings
replace the token embedding lookup at the prompt's positions; greedy tokens are transformers' generate(inputs_embeds)
with the same weights. Their prefix-cache blocks are keyed by the embeddings' content, never by the placeholder
token ids they carry."""
from __future__ import annotations

import argparse

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.cli_args import add_serve_args, parse_serve_args, to_engine_args

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def hf_generate_from_embeds(model_dir: str, embeds: torch.Tensor, max_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mask = torch.ones(1, embeds.shape[0], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(inputs_embeds=embeds[None], attention_mask=mask, max_new_tokens=max_tokens,
                             do_sample=False)
    return out[0, -max_tokens:].tolist()  # (from inputs_embeds alone, generate returns only the new tokens)


def _embeds(n: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 0.5


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_prompt_embeds=True, num_gpu_blocks_override=64,
              max_model_len=256)
    yield llm
    llm.shutdown()


def test_embeds_prompts_generate_transformers_tokens_beside_token_prompts(llm, tiny_llama_dir):
    hidden = llm.engine.hidden_size
    first, second = _embeds(5, hidden, 1), _embeds(19, hidden, 2)
    token_prompt = [5, 6, 7, 8]
    alone = llm.generate([token_prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([{"prompt_embeds": first}, token_prompt, {"prompt_embeds": second[None]}], GREEDY,
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_generate_from_embeds(tiny_llama_dir, first, 6)
    assert outs[1].outputs[0].token_ids == alone  # a token prompt in the same batch is untouched
    assert outs[2].outputs[0].token_ids == hf_generate_from_embeds(tiny_llama_dir, second, 6)  # [1, n, hidden] too
    assert outs[0].prompt_token_ids == [] and outs[0].prompt is None  # no tokens to show, as vLLM
    # truncate_prompt_tokens keeps the last rows, as it keeps the last tokens
    cut = llm.generate({"prompt_embeds": second}, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                                 truncate_prompt_tokens=7), use_tqdm=False)
    assert cut[0].outputs[0].token_ids == hf_generate_from_embeds(tiny_llama_dir, second[-7:], 6)


def test_embeds_prompts_never_hit_token_prompts_blocks(llm, tiny_llama_dir):
    """The placeholder ids of an embeddings prompt are those of a token prompt of zeros: that prompt's cached blocks
    must not serve it. The same embeddings again do hit their own blocks (keyed by content)."""
    llm.reset_prefix_cache()
    zeros = [0] * 40
    llm.generate([zeros], GREEDY, use_tqdm=False)
    embeds = _embeds(40, llm.engine.hidden_size, 3)
    want = hf_generate_from_embeds(tiny_llama_dir, embeds, 6)
    first = llm.generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == want and first.num_cached_tokens == 0
    again = llm.generate({"prompt_embeds": embeds.clone()}, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want and again.num_cached_tokens == 32  # two full blocks of 16
    other = embeds.clone()
    other[0, 0] += 1.0  # a different first row: a different chain from the first block on
    assert llm.generate({"prompt_embeds": other}, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_embeds_prompt_refusals(llm, tiny_llama_dir):
    hidden = llm.engine.hidden_size
    for bad, message in [(torch.zeros(3, hidden + 1), rf"shape \[num_tokens, {hidden}\].*got \[3, {hidden + 1}\]"),
                         (torch.zeros(0, hidden), "shape"), (torch.zeros(3, hidden, dtype=torch.long), "floating"),
                         ([[0.0] * hidden], "must be a torch.Tensor"),
                         (torch.full((2, hidden), float("nan")), "finite")]:
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt_embeds": bad}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="one of 'prompt', 'prompt_token_ids' and 'prompt_embeds'"):
        llm.generate({"prompt_embeds": torch.zeros(2, hidden), "prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs and pooling need the prompt's token ids"):
        llm.generate({"prompt_embeds": torch.zeros(2, hidden)},
                     SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="for generate"):
        llm.embed({"prompt_embeds": torch.zeros(2, hidden)}, use_tqdm=False)
    plain = LLM(model=tiny_llama_dir, num_gpu_blocks_override=16, max_model_len=256)
    with pytest.raises(ValueError, match=r"^You must set `--enable-prompt-embeds` to input `prompt_embeds`\.$"):
        plain.generate({"prompt_embeds": torch.zeros(2, hidden)}, GREEDY, use_tqdm=False)
    plain.shutdown()
    with pytest.raises(ValueError, match="enable_prompt_embeds with speculative decoding"):
        EngineArgs(enable_prompt_embeds=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                   "prompt_lookup_max": 3}).validate()


def test_enable_prompt_embeds_flag(tmp_path):
    def serve(argv):
        return to_engine_args(parse_serve_args(add_serve_args(argparse.ArgumentParser(), positional_model=True), argv))

    assert serve(["m", "--enable-prompt-embeds"]).enable_prompt_embeds and not serve(["m"]).enable_prompt_embeds
    (tmp_path / "serve.yaml").write_text("enable-prompt-embeds: true\n")
    assert serve(["m", "--config", str(tmp_path / "serve.yaml")]).enable_prompt_embeds


def test_gemma_takes_given_embeddings_as_its_scaled_input_embeddings(tiny_model_dir):
    """Gemma scales its token embeddings by sqrt(hidden); given ones stand for the scaled input embeddings (what
    transformers 5 and vLLM take as inputs_embeds: the scale lives in the lookup), so they are not scaled again."""
    model_dir = tiny_model_dir("gemma2")
    llm = LLM(model=model_dir, dtype="float32", enable_prompt_embeds=True, num_gpu_blocks_override=16,
              max_model_len=256)
    embeds = _embeds(9, llm.engine.hidden_size, 4) * 0.1
    out = llm.generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    assert out == hf_generate_from_embeds(model_dir, embeds, 6)


def test_repetition_penalty_ignores_the_placeholder_ids(llm):
    # An embeddings prompt has no token ids; the placeholder id (0) it carries was penalized as a prompt token.
    from pagedllm.prompt_embeds import PROMPT_EMBEDS_PLACEHOLDER as PH

    embeds = _embeds(6, llm.engine.hidden_size, 3)
    favour = dict(temperature=0.0, max_tokens=1, logit_bias={PH: 50.0})  # the placeholder's id is the greedy token
    plain = llm.generate({"prompt_embeds": embeds}, SamplingParams(**favour), use_tqdm=False)
    pen = llm.generate({"prompt_embeds": embeds}, SamplingParams(repetition_penalty=1e6, **favour), use_tqdm=False)
    assert plain[0].outputs[0].token_ids == [PH]
    assert pen[0].outputs[0].token_ids == [PH]  # nothing was generated yet: nothing to penalize
