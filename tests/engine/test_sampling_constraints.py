"""logit_bias, allowed_token_ids and bad_words through the whole engine (batched with unconstrained requests,
plain greedy so the CPU argmax shortcut would otherwise apply), against transformers' logits with the same
constraint applied by hand."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_constraints import tokenize_bad_words
from tests.engine.test_correctness import _hf_model, hf_greedy, random_prompts


def hf_constrained_greedy(model_dir: str, prompt: list[int], n: int, edit) -> list[int]:
    """Greedy decoding where `edit(logits, generated)` changes each step's logits first."""
    model = _hf_model(model_dir)
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            tok = int(edit(logits.clone(), out).argmax())
            out.append(tok)
            ids.append(tok)
    return out


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64)


def test_logit_bias_and_allowed_ids_match_transformers(llm, tiny_llama_dir):
    prompts = random_prompts([9, 14, 5], seed=41)
    greedy0 = hf_greedy(tiny_llama_dir, prompts[0], 1)[0][0]
    bias = {greedy0: -100.0, 77: 3.0}
    allowed = list(range(100, 140))
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias=bias),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def add_bias(logits, _):
        for t, v in bias.items():
            logits[t] += v
        return logits

    def only_allowed(logits, _):
        mask = torch.full_like(logits, float("-inf"))
        mask[allowed] = 0.0
        return logits + mask

    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == hf_constrained_greedy(tiny_llama_dir, prompts[0], 6, add_bias)
    assert got[0][0] != greedy0  # -100 on the greedy token changes it
    assert got[1] == hf_constrained_greedy(tiny_llama_dir, prompts[1], 6, only_allowed)
    assert got[2] == hf_greedy(tiny_llama_dir, prompts[2], 6)[0]  # its unconstrained neighbour is untouched


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_never_appear(tiny_llama_dir, async_scheduling):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64, async_scheduling=async_scheduling)
    tok = llm.get_tokenizer()
    prompt = random_prompts([7], seed=43)[0]
    plain = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    # ban a multi-token piece and a single token of what the model says unconstrained
    words = [tok.decode(plain.token_ids[2:4]), tok.decode(plain.token_ids[6:7])]
    seqs = tokenize_bad_words(words, tok)
    assert any(len(s) > 1 for s in seqs)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=words),
                       use_tqdm=False)[0].outputs[0]
    ids = out.token_ids
    for seq in seqs:
        assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1)), (seq, ids)

    def ban(logits, generated):
        for seq in seqs:
            if len(generated) >= len(seq) - 1 and (len(seq) == 1 or generated[len(generated) - len(seq) + 1:] ==
                                                   seq[:-1]):
                logits[seq[-1]] = float("-inf")
        return logits

    assert ids == hf_constrained_greedy(tiny_llama_dir, prompt, 12, ban)


def test_offline_refusals(llm):
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate("hi", SamplingParams(logit_bias={10_000: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs=21 is more than this server allows"):
        llm.generate("hi", SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="best_of > n is not supported yet"):
        SamplingParams(n=1, best_of=2)


def test_min_tokens_forbids_eos_also_with_ignore_eos(llm):
    # vLLM's min_tokens: no EOS "before min_tokens tokens" whatever ignore_eos says (the model's EOS is in its
    # all_stop_token_ids unconditionally); ignore_eos only keeps an EOS from ending the request.
    eos = llm.engine.eos_token_ids[0]
    prompt = random_prompts([7], seed=5)[0]
    params = [SamplingParams(temperature=0, max_tokens=6, min_tokens=4, ignore_eos=ignore, logit_bias={eos: 100.0})
              for ignore in (True, False)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False)
    with_ignore, plain = (o.outputs[0].token_ids for o in outs)
    assert eos not in with_ignore[:4] and with_ignore[4:] == [eos, eos]
    assert eos not in plain[:4] and plain[4:] == [eos]
