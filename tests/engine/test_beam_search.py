"""LLM.beam_search against transformers' generate(num_beams, length_penalty, early_stopping): same beams in the
same order, same scores within fp32 tolerance, on tiny random models (with an EOS the model often emits, so beams
finish early) and on SmolLM2."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from pagedllm import LLM, BeamSearchParams

from tests.engine.test_correctness import _hf_model


def hf_beams(model_dir, prompt, width, max_tokens, length_penalty, early_stopping, eos):
    g = _hf_model(model_dir).generate(
        torch.tensor([prompt]), num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens,
        length_penalty=length_penalty, early_stopping=early_stopping, do_sample=False, output_scores=True,
        return_dict_in_generate=True, eos_token_id=eos, pad_token_id=eos[0], attention_mask=torch.ones(1, len(prompt),
                                                                                                     dtype=torch.long))
    return g.sequences.tolist(), g.sequences_scores.tolist()


def check(llm, model_dir, prompts, params, eos):
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    finished_early = 0
    for prompt, out in zip(prompts, outs):
        ref_seqs, ref_scores = hf_beams(model_dir, prompt, params.beam_width, params.max_tokens, params.length_penalty,
                                        params.early_stopping, eos)
        assert len(out.sequences) == params.beam_width
        for seq, ref, ref_score in zip(out.sequences, ref_seqs, ref_scores):
            assert seq.tokens == ref[:len(seq.tokens)]
            assert all(t == eos[0] for t in ref[len(seq.tokens):])  # transformers pads shorter beams
            assert seq.score == pytest.approx(ref_score, rel=1e-4, abs=1e-4)
            gen = seq.tokens[len(prompt):]
            assert len(seq.logprobs) == len(gen)
            assert seq.cum_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(seq.logprobs, gen)), abs=1e-5)
            finished_early += len(gen) < params.max_tokens
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
    return finished_early


@pytest.fixture(scope="module")
def eos_llama(tiny_model_dir, tmp_path_factory):
    """The tiny llama with its EOS moved to a token it often emits, so that beams end at different lengths."""
    src = tiny_model_dir("llama")
    dst = str(tmp_path_factory.mktemp("eos-llama"))
    shutil.copytree(src, dst, dirs_exist_ok=True)
    llm = LLM(src, kv_cache_memory_bytes=1 << 24, max_model_len=256)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 512) for _ in range(6)] for _ in range(4)]
    counts: dict[int, int] = {}
    for out in llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=8)):
        for seq in out.sequences:
            for t in seq.tokens[6:]:
                counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(dst, name)
        with open(path) as f:
            data = json.load(f)
        data["eos_token_id"] = eos
        with open(path, "w") as f:
            json.dump(data, f)
    _hf_model(dst).generation_config.eos_token_id = eos
    return dst, eos, prompts


@pytest.mark.parametrize("width, length_penalty, early_stopping",
                         [(2, 1.0, False), (4, 0.5, True), (3, 1.5, "never"), (3, -0.5, False)])
def test_tiny_llama_matches_transformers(eos_llama, width, length_penalty, early_stopping):
    model_dir, eos, _ = eos_llama
    rng = random.Random(width)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (5, 19, 9)]
    llm = LLM(model_dir, kv_cache_memory_bytes=1 << 24, max_model_len=256, block_size=8)
    params = BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    check(llm, model_dir, prompts, params, [eos])


def test_beam_forks_copy_the_last_partial_block(eos_llama):
    """Beams share their prompt's full blocks through the prefix cache and fork the last partial block by copy: after
    the first step every beam request computes exactly one token (its newest), and the beams still equal
    transformers'. Async scheduling (the CUDA default) on the CPU path too."""
    model_dir, eos, _ = eos_llama
    rng = random.Random(11)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (13, 6)]
    for async_scheduling in (False, True):
        llm = LLM(model_dir, kv_cache_memory_bytes=1 << 24, max_model_len=256, block_size=8,
                  async_scheduling=async_scheduling)
        engine, kv = llm.engine, llm.engine.scheduler.kv_cache_manager
        added = []
        add = engine.add_request
        engine.add_request = lambda req: (added.append(len(req.prompt_token_ids)), add(req))[1]
        check(llm, model_dir, prompts, BeamSearchParams(beam_width=3, max_tokens=9, ignore_eos=True), [eos])
        computed = kv.prefix_cache_queries - kv.prefix_cache_hits
        first_step = sum(len(p) for p in prompts)  # each prompt alone, computed in full
        assert computed == first_step + len(added) - len(prompts), (computed, len(added))
        assert kv.num_partial_block_copies > 0


def test_beams_finish_early_at_eos(eos_llama):
    model_dir, eos, prompts = eos_llama
    llm = LLM(model_dir, kv_cache_memory_bytes=1 << 24, max_model_len=256)
    # length_penalty 0: a beam's score is its cumulative logprob, so a beam that ends early ranks high
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.0, early_stopping=True)
    assert check(llm, model_dir, prompts, params, [eos]) > 0
    # vLLM's beams: one that ended at EOS names it as its stop_reason (it was None), one cut at max_tokens has none
    seqs = [s for o in llm.beam_search([{"prompt_token_ids": p} for p in prompts], params) for s in o.sequences]
    assert {s.finish_reason for s in seqs} == {"stop", "length"}
    assert all(s.stop_reason == (eos if s.finish_reason == "stop" else None) for s in seqs)


def test_concurrency_limit_searches_prompts_in_groups(eos_llama):
    """vLLM's beam_search(concurrency_limit=N) (a TypeError here before): the prompts are searched N at a time, each
    search's beams the same as with all prompts at once; a bad limit is a ValueError."""
    model_dir, eos, prompts = eos_llama
    llm = LLM(model_dir, kv_cache_memory_bytes=1 << 24, max_model_len=256)
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    inputs = [{"prompt_token_ids": p} for p in prompts[:3]]
    together = llm.beam_search(inputs, params)
    grouped = llm.beam_search(inputs, params, concurrency_limit=2)
    assert [[s.tokens for s in o.sequences] for o in grouped] == [[s.tokens for s in o.sequences] for o in together]
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="concurrency_limit must be an integer >= 1 or None"):
            llm.beam_search(inputs, params, concurrency_limit=bad)


def test_tiny_qwen2_and_ignore_eos(tiny_qwen2_dir):
    llm = LLM(tiny_qwen2_dir, kv_cache_memory_bytes=1 << 24, max_model_len=256)
    prompts = [[3, 4, 5, 6, 7], list(range(40, 75))]
    check(llm, tiny_qwen2_dir, prompts, BeamSearchParams(beam_width=2, max_tokens=8), [1])
    out = llm.beam_search({"prompt_token_ids": prompts[0]}, BeamSearchParams(beam_width=2, max_tokens=6,
                                                                          ignore_eos=True))
    assert all(len(s.tokens) == 5 + 6 for s in out[0].sequences)


def test_smollm2_matches_transformers(smollm2_hf_dir):
    llm = LLM(smollm2_hf_dir, dtype="float32", num_gpu_blocks_override=256, max_model_len=4096)
    tok = llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                   tokenize=True)
    chat = list(chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "input_ids") else chat)
    eos = list(llm.engine.eos_token_ids)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    check(llm, smollm2_hf_dir, [chat], params, eos)
    out = llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=2, max_tokens=3))
    prompt = tok.encode("The capital of France is")
    assert out[0].sequences[0].text and out[0].sequences[0].tokens[:len(prompt)] == prompt


def test_bad_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")


def test_beam_width_beyond_max_logprobs_fails_clearly(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=1 << 24, max_model_len=128, max_logprobs=8)
    with pytest.raises(ValueError, match="max-logprobs"):
        llm.beam_search({"prompt_token_ids": [3, 4]}, BeamSearchParams(beam_width=5, max_tokens=2))
    assert len(llm.beam_search({"prompt_token_ids": [3, 4]}, BeamSearchParams(beam_width=2, max_tokens=2))[0]
               .sequences) == 2


def test_beams_stop_at_the_context_end(tiny_model_dir):
    """A prompt near max_model_len: the beams grow to the context's end (max_tokens clamped to the room, as
    generate() clamps), instead of failing mid-search; a prompt with no room is refused up front."""
    llm = LLM(tiny_model_dir("llama"), kv_cache_memory_bytes=1 << 24, max_model_len=64)
    out = llm.beam_search([{"prompt_token_ids": [5] * 60}], BeamSearchParams(beam_width=2, max_tokens=16))
    assert out[0].sequences and all(len(s.tokens) <= 64 for s in out[0].sequences)
    assert max(len(s.tokens) for s in out[0].sequences) == 64 or any(s.tokens[-1] in llm.engine.eos_token_ids
                                                                        for s in out[0].sequences)
    with pytest.raises(ValueError, match="leaves no room"):
        llm.beam_search([{"prompt_token_ids": [5] * 64}], BeamSearchParams(beam_width=2, max_tokens=4))


def test_beam_logprobs_carry_their_decoded_tokens(tiny_llama_dir):
    """vLLM's beam steps detokenize their logprobs: every Logprob of a beam names its token's text (it was None)."""
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=1 << 24, max_model_len=128)
    tok = llm.get_tokenizer()
    out = llm.beam_search(["hello world"], BeamSearchParams(beam_width=2, max_tokens=4))[0]
    entries = [(t, lp) for seq in out.sequences for d in seq.logprobs for t, lp in d.items()]
    assert entries and all(lp.decoded_token == tok.decode([t]) for t, lp in entries)


@pytest.mark.parametrize("max_logprobs", [20, -1])
def test_beams_wider_than_half_the_vocabulary(tmp_path, max_logprobs):
    """A beam step asks for the top 2 x width logprobs; past the vocabulary's size the engine refused the step
    ("logprobs=12 is more than this server allows (8)"): it asks for the whole vocabulary instead, and the beams are
    transformers' (which takes its top 2 x width over all beams' continuations)."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_hf_config

    config = tiny_hf_config("llama")
    config.vocab_size = 8
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # peaked distributions: no near-ties between beams
        model.lm_head.weight.mul_(20)
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory_bytes=1 << 24, max_model_len=64, skip_tokenizer_init=True,
              max_logprobs=max_logprobs)
    for width in (4, 6, 10):
        check(llm, str(tmp_path), [[2, 3, 4, 5]], BeamSearchParams(beam_width=width, max_tokens=5), [1])
