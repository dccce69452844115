"""Dynamic NTK rope past the model's context (VLLM_ALLOW_LONG_MAX_MODEL_LEN): pagedllm gives transformers'
generation numbers. transformers recomputes the base per forward from the sequence length and keeps cached keys as
they were rotated, so the token at position p is rotated with the base for max(p + 1, prompt length, M); the
engine's tokens are too, whatever the chunking, and prefix-cache hits never mix bases (was: one base for the
engine's whole context, which changed even short sequences' logits)."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.rotary_embedding import DynamicNTKRotaryEmbedding, get_rope

M = 32  # the tiny model's max_position_embeddings
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return tiny_model_dir("llama", rope_scaling=DYNAMIC, max_position_embeddings=M)


def _hf_generate(model_dir: str, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generation with its KV cache, from a fresh model (its rope keeps state across calls)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = torch.stack([torch.log_softmax(step[0].float(), -1)[t] for step, t in zip(out.logits, tokens)])
    return tokens, logprobs


def test_rows_are_transformers_generation_rows() -> None:
    """Row p of the table: position p with transformers' inverse frequencies for a sequence of max(p + 1, M)
    (its float32 arithmetic on the length tensor, bit for bit); scratch rows: a prompt's length's."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=M,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    rope = get_rope(16, M, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert isinstance(rope, DynamicNTKRotaryEmbedding)
    within = rope.cos_sin_cache.clone()
    rope.set_context_len(48)
    assert torch.equal(rope.cos_sin_cache[:M], within)  # unscaled within M
    for p, seq_len in [(M, M + 1), (40, 41), (47, 48), (5, 40)]:
        inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=torch.tensor(seq_len))
        freqs = inv * float(p)
        expected = torch.cat([freqs.cos(), freqs.sin()])
        if p + 1 == seq_len:
            assert torch.equal(rope.cos_sin_cache[p], expected), p
        rope.reserve_scratch(4)
        rope.write_rows(torch.tensor([p]), torch.tensor([seq_len]))
        assert torch.equal(rope.cos_sin_cache[rope.scratch_start], expected), (p, seq_len)


def test_engine_matches_transformers_generation(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts past M and within it, decoding past M, chunked 16 tokens a step; then prefix-cache hits: an extended
    long prompt (rotated with another base) takes none, the same one all its full blocks."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    llm = LLM(model=model_dir, dtype="float32", max_model_len=64, num_gpu_blocks_override=32, block_size=16,
              max_num_batched_tokens=16, max_num_seqs=4)
    g = torch.Generator().manual_seed(0)
    long = torch.randint(2, 512, (40,), generator=g).tolist()
    short = torch.randint(2, 512, (20,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=0)
    rounds = [[long, short], [long + [5, 6, 7, 8], long]]
    outs = [o for prompts in rounds
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    for prompt, out in zip([p for r in rounds for p in r], outs):
        tokens, logprobs = _hf_generate(model_dir, prompt, 14)
        got = out.outputs[0]
        assert got.token_ids == tokens, len(prompt)
        ours = torch.tensor([next(iter(entry.values())).logprob for entry in got.logprobs])
        torch.testing.assert_close(ours, logprobs, atol=2e-5, rtol=0)
    assert [o.num_cached_tokens for o in outs[2:]] == [0, 32]


def test_long_prompt_roots() -> None:
    """A long prompt's blocks hash under a root of its length, apart from every salted or LongRoPE root."""
    from pagedllm.core.block_hash import chain_root

    roots = [chain_root(ntk_prompt_len=40), chain_root(ntk_prompt_len=44), chain_root("N40:"), chain_root("x"),
             chain_root(rope_long=True), chain_root("x", ntk_prompt_len=40), None]
    assert len(set(roots)) == len(roots)
