"""Our models vs the transformers reference on tiny random checkpoints (fp32, one sequence, no KV cache)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.models.loader import get_model, load_hf_config

ATOL = 1e-4
PROMPT_LEN = 48  # > original_max_position_embeddings / low_freq_factor of the llama3 rope => all bands used


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _ours(model_dir, load_format="auto"):
    return get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu",
                     load_format=load_format)


def _logits(model, ids):
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0])))


def _greedy(step_logits, prompt, n):
    ids = prompt.clone()
    for _ in range(n):
        ids = torch.cat([ids, step_logits(ids)[-1].argmax().view(1)])
    return ids[len(prompt):].tolist()


def _check_against_hf(model_dir, num_new_tokens=6):
    hf, ours = _hf_model(model_dir), _ours(model_dir)
    ids = torch.randint(0, hf.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    out = _logits(ours, ids)
    assert out.dtype == torch.float32 and out.shape == (PROMPT_LEN, hf.config.vocab_size)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    with torch.inference_mode():
        hf_tokens = _greedy(lambda x: hf(x[None]).logits[0], ids, num_new_tokens)
    assert _greedy(lambda x: _logits(ours, x), ids, num_new_tokens) == hf_tokens
    return ours


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_matches_transformers(tiny_model_dir, arch):
    ours = _check_against_hf(tiny_model_dir(arch))
    assert len(ours.attn_layers) == 2
    assert [a.prefix for a in ours.attn_layers] == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def test_sharded_checkpoint(tiny_model_dir):
    import os
    model_dir = tiny_model_dir("llama", sharded=True)
    assert os.path.isfile(os.path.join(model_dir, "model.safetensors.index.json"))
    _check_against_hf(model_dir, num_new_tokens=2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tied_embeddings(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch, tie_word_embeddings=True)
    ours = _check_against_hf(model_dir, num_new_tokens=2)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(ours.named_parameters())


def test_untied_lm_head_is_separate(tiny_qwen3_dir):
    ours = _ours(tiny_qwen3_dir)
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight


@pytest.mark.parametrize("rope_scaling", [{"rope_type": "linear", "factor": 2.0},
                                          {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 64}])
def test_rope_scaling_variants(tiny_model_dir, rope_scaling):
    _check_against_hf(tiny_model_dir("llama", rope_scaling=rope_scaling), num_new_tokens=1)


def test_dynamic_ntk_rope_matches_transformers(tiny_model_dir):
    """Dynamic NTK, one sequence per forward (no runner): transformers' forward, the unscaled base for a sequence
    within max_position_embeddings, the base scaled for its length past it (a 48-token prompt, model context 32),
    whatever the engine's context (generation with a KV cache: tests/models/test_dynamic_ntk.py)."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    _check_against_hf(tiny_model_dir("llama", rope_scaling=dynamic))
    model_dir = tiny_model_dir("llama", rope_scaling=dynamic, max_position_embeddings=32)
    ours = get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu", max_model_len=48)
    assert ours.model.rotary_emb.cos_sin_cache.shape[0] == 48
    ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = _hf_model(model_dir)(ids[None]).logits[0]
    torch.testing.assert_close(_logits(ours, ids), ref, atol=ATOL, rtol=1e-4)
    with torch.inference_mode():
        ref32 = _hf_model(model_dir)(ids[None, :32]).logits[0]
    torch.testing.assert_close(_logits(ours, ids[:32]), ref32, atol=ATOL, rtol=1e-4)  # (was: scaled for 48)
    assert (ref32 - ref[:32]).abs().max() > 1e-3  # the base does depend on the length


def test_llama3_rope_scaling_is_applied(tiny_llama_dir):
    """Guard against the scaled rope silently falling back to the default one."""
    from pagedllm.layers.rotary_embedding import get_rope
    assert load_hf_config(tiny_llama_dir).rope_parameters["rope_type"] == "llama3"
    ids = torch.arange(PROMPT_LEN)
    model = _ours(tiny_llama_dir)
    scaled = _logits(model, ids)
    default_rope = get_rope(16, 512, {"rope_type": "default", "rope_theta": 10000.0})
    model.model.rotary_emb.cos_sin_cache.copy_(default_rope.cos_sin_cache)
    assert not torch.allclose(scaled, _logits(model, ids), atol=1e-4)


def test_load_weights_returns_loaded_names(tiny_llama_dir):
    from safetensors.torch import load_file
    import os
    model = get_model(load_hf_config(tiny_llama_dir), tiny_llama_dir, dtype=torch.float32, device="cpu",
                      load_format="dummy")
    weights = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    loaded = model.load_weights(weights.items())
    assert loaded == set(dict(model.named_parameters()))
    assert "model.layers.0.self_attn.qkv_proj.weight" in loaded
    assert "model.layers.1.mlp.gate_up_proj.weight" in loaded
    weights.pop("model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\).*model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        model.load_weights(weights.items())


def test_forward_without_context_is_one_causal_sequence_at_the_given_positions(tiny_qwen2_dir):
    """Without a forward context (no KV cache: profiling, these tests) the model reads its rows as one causal
    sequence whose rotary positions are the `positions` argument, not the row index: logits equal
    transformers' given the same position_ids (with a gap), a row never sees later rows, and [T, hidden]
    comes back contiguous."""
    hf, model = _hf_model(tiny_qwen2_dir), _ours(tiny_qwen2_dir)
    ids = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([0, 1, 2, 3, 10, 11, 12])
    with torch.inference_mode():
        hidden = model(ids, positions)
        ref = hf(ids[None], position_ids=positions[None]).logits[0].float()
        contiguous_pos = model.compute_logits(model(ids, torch.arange(7)))
    assert hidden.shape == (7, 64) and hidden.is_contiguous()
    torch.testing.assert_close(model.compute_logits(hidden), ref, atol=ATOL, rtol=0)
    # the gap matters (so positions really drive rope): rows after it differ from contiguous positions
    assert torch.allclose(contiguous_pos[:4], ref[:4], atol=ATOL)
    assert not torch.allclose(contiguous_pos[4:], ref[4:], atol=1e-3)
    changed = ids.clone()
    changed[5] = (changed[5] + 1) % 512
    with torch.inference_mode():
        other = model(changed, positions)
    torch.testing.assert_close(other[:5], hidden[:5], atol=1e-6, rtol=0)
    assert not torch.allclose(other[5:], hidden[5:], atol=1e-4)


def test_bfloat16_build(tiny_qwen3_dir):
    model = get_model(load_hf_config(tiny_qwen3_dir), tiny_qwen3_dir, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    ids = torch.arange(10)
    logits = _logits(model, ids)
    ref = _logits(_ours(tiny_qwen3_dir), ids)
    assert logits.dtype == torch.float32
    assert (logits - ref).abs().max() < 0.05


@pytest.mark.parametrize("override,rope", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e6}),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}),
    ({"rope_theta": 5e5}, {"rope_type": "default", "rope_theta": 5e5})], ids=["yarn", "legacy-linear", "theta"])
def test_rope_overrides_keep_the_models_base(tiny_model_dir, override, rope):
    """hf_overrides of the rope (Qwen's documented {"rope_scaling": {"rope_type": "yarn", ...}} for its long context)
    give transformers' model of the same config with the scaling over the model's base (1e6 here): transformers 5
    replaced rope_parameters whole, so the base fell to 10 000; a rope_theta override was not applied at all."""
    from transformers import AutoConfig, AutoModelForCausalLM
    model_dir = tiny_model_dir("qwen2", rope_scaling={"rope_type": "default", "rope_theta": 1e6})
    config = AutoConfig.from_pretrained(model_dir)
    config.rope_parameters = rope
    hf = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    ours = get_model(load_hf_config(model_dir, overrides=override), model_dir, dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(_logits(ours, ids), ref, atol=ATOL, rtol=1e-4)
