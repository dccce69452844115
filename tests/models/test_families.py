"""Gemma 2, Gemma 3 and Phi-3 models against transformers on tiny random checkpoints (tests/models/family_configs.py;
fp32, one sequence, no KV cache), and checks that each family feature really runs: soft-capping, the local rope,
LongRoPE's short / long factors, partial rotary, the Gemma norm, bf16."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from pagedllm.models.loader import get_model, load_hf_config

ATOL = 1e-4


def _hf(model_dir: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    # eager: transformers versions that run Gemma 2 on SDPA (5.17) drop its attention soft-capping
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()


def _ours(model_dir: str, dtype=torch.float32, max_model_len: Optional[int] = None):
    return get_model(load_hf_config(model_dir), model_dir, dtype=dtype, device="cpu", max_model_len=max_model_len)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0])))


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _greedy(step_logits, prompt: torch.Tensor, n: int) -> list[int]:
    ids = prompt.clone()
    for _ in range(n):
        ids = torch.cat([ids, step_logits(ids)[-1].argmax().view(1)])
    return ids[len(prompt):].tolist()


def check_against_hf(model_dir: str, prompt_len: int, num_new_tokens: int = 6, max_model_len: Optional[int] = None):
    hf, ours = _hf(model_dir), _ours(model_dir, max_model_len=max_model_len)
    ids = _ids(prompt_len)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    out = _logits(ours, ids)
    assert out.dtype == torch.float32 and out.shape == (prompt_len, 512)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    with torch.inference_mode():
        hf_tokens = _greedy(lambda x: hf(x[None]).logits[0], ids, num_new_tokens)
    assert _greedy(lambda x: _logits(ours, x), ids, num_new_tokens) == hf_tokens
    return ours


@pytest.mark.parametrize("arch,prompt_len,max_model_len", [
    ("gemma2", 48, None), ("gemma3", 48, None), ("phi3_plain", 48, None),
    ("phi3", 26, 32),   # within the original context: the short factors, as transformers for a short sequence
    ("phi3", 48, None),  # past it (engine context 256): the long factors, as transformers for a long sequence
    ("phi3", 28, None),  # engine context 256, a sequence growing from 28 to 34: short, then long from 33 on
])
def test_matches_transformers(tiny_model_dir, arch, prompt_len, max_model_len):
    ours = check_against_hf(tiny_model_dir(arch), prompt_len, max_model_len=max_model_len)
    n = ours.config.num_hidden_layers
    assert [a.prefix for a in ours.attn_layers] == [f"model.layers.{i}.self_attn.attn" for i in range(n)]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_layers(tiny_model_dir, arch):
    ours = _ours(tiny_model_dir(arch))
    config = ours.config
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied
    assert [a.sliding_window for a in ours.attn_layers] == [
        512 if t == "sliding_attention" else None for t in config.layer_types]
    assert {a.scale for a in ours.attn_layers} == {24 ** -0.5}  # query_pre_attn_scalar, not head_dim (32)
    norm = ours.model.layers[0].input_layernorm
    assert norm.weight.dtype == torch.float32
    from safetensors.torch import load_file
    import os
    w = load_file(os.path.join(tiny_model_dir(arch), "model.safetensors"))["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm.weight, w + 1)  # (1 + w), w not zero (family_configs.randomize_norms)
    if arch == "gemma2":
        assert [a.logits_soft_cap for a in ours.attn_layers] == [1.0] * 4 and ours.final_logit_softcap == 2.0
    else:
        assert [a.logits_soft_cap for a in ours.attn_layers] == [None] * 6 and ours.final_logit_softcap is None
        local = ours.model.local_rotary_emb
        assert [layer.self_attn.rotary_emb is local for layer in ours.model.layers] == [True] * 5 + [False]
        assert ours.model.layers[5].self_attn.rotary_emb is ours.model.rotary_emb


def test_gemma2_soft_caps_change_the_result(tiny_model_dir):
    """Guard against a cap silently not applied: without either cap the logits move well past the tolerance."""
    ids = _ids(48)
    model = _ours(tiny_model_dir("gemma2"))
    capped = _logits(model, ids)
    model.final_logit_softcap = None
    uncapped_final = _logits(model, ids)
    assert (uncapped_final - capped).abs().max() > 0.1
    assert torch.equal(torch.tanh(uncapped_final / 2.0) * 2.0, capped)
    for attn in model.attn_layers:
        attn.logits_soft_cap, attn._soft_cap_kwargs = None, {}
    assert (_logits(model, ids) - uncapped_final).abs().max() > 0.01


def test_gemma3_local_rope_is_its_own(tiny_model_dir):
    """The local layers rotate with base 1e4 unscaled, the global one with 1e6 and linear scaling x2."""
    from pagedllm.layers.rotary_embedding import get_rope
    model = _ours(tiny_model_dir("gemma3"))
    local, full = model.model.local_rotary_emb, model.model.rotary_emb
    assert torch.equal(local.cos_sin_cache, get_rope(32, 512, {"rope_type": "default", "rope_theta": 1e4})
                       .cos_sin_cache)
    assert torch.equal(full.cos_sin_cache, get_rope(32, 512, {"rope_type": "linear", "factor": 2.0,
                                                              "rope_theta": 1e6}).cos_sin_cache)
    ids = _ids(48)
    before = _logits(model, ids)
    for layer in model.model.layers[:5]:
        layer.self_attn.rotary_emb = full
    assert (_logits(model, ids) - before).abs().max() > 1e-3


def test_phi3_longrope_and_partial_rotary(tiny_model_dir):
    """An engine context past the original one (32) holds both tables, the long rows after the short ones; within
    it only the short rows. A plain forward (one sequence) takes transformers' per-forward choice."""
    from pagedllm.layers.rotary_embedding import LongRopeEmbedding
    model_dir = tiny_model_dir("phi3")
    long_ctx, short_ctx = _ours(model_dir), _ours(model_dir, max_model_len=32)
    rope = long_ctx.model.rotary_emb
    assert isinstance(rope, LongRopeEmbedding) and rope.rotary_dim == 12 and rope.head_size == 16
    assert rope.long_offset == 256 and short_ctx.model.rotary_emb.long_offset is None
    assert rope.cos_sin_cache.shape[0] == 512
    scaling = (1 + torch.log(torch.tensor(8.0)) / torch.log(torch.tensor(32.0))) ** 0.5  # factor 256 / 32
    torch.testing.assert_close(rope.cos_sin_cache[0, :6], torch.full((6,), float(scaling)))
    torch.testing.assert_close(rope.cos_sin_cache[256, :6], torch.full((6,), float(scaling)))
    assert torch.equal(rope.cos_sin_cache[:256], short_ctx.model.rotary_emb.cos_sin_cache)
    short_ids, long_ids = _ids(26), _ids(40)
    torch.testing.assert_close(_logits(long_ctx, short_ids), _logits(short_ctx, short_ids), atol=0, rtol=0)
    long_logits = _logits(long_ctx, long_ids)
    with torch.inference_mode():
        ref = _hf(model_dir)(long_ids[None]).logits[0].float()
    torch.testing.assert_close(long_logits, ref, atol=ATOL, rtol=1e-4)
    rope.offsets = torch.zeros(64, dtype=torch.int64)  # as the runner gives: zero offsets read the short rows
    assert (_logits(long_ctx, long_ids) - long_logits).abs().max() > 1e-3
    rope.set_context_len(32)  # the short table alone
    assert rope.long_offset is None and torch.equal(rope.cos_sin_cache, short_ctx.model.rotary_emb.cos_sin_cache)


def test_phi3_fused_checkpoint_tensors_load_as_shards(tiny_model_dir):
    """qkv_proj / gate_up_proj arrive fused and land on our fused parameters unchanged (one rank)."""
    import os
    from safetensors.torch import load_file
    model_dir = tiny_model_dir("phi3_plain")
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in tensors and "model.layers.0.mlp.gate_up_proj.weight" in tensors
    model = _ours(model_dir)
    layer = model.model.layers[0]
    assert torch.equal(layer.self_attn.qkv_proj.weight, tensors["model.layers.0.self_attn.qkv_proj.weight"])
    assert torch.equal(layer.mlp.gate_up_proj.weight, tensors["model.layers.0.mlp.gate_up_proj.weight"])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_bfloat16_matches_transformers_bfloat16(tiny_model_dir, arch):
    """bf16: Gemma's norms in float32 then cast, the embedding scale rounded to bf16, as transformers computes."""
    model_dir = tiny_model_dir(arch)
    ours, hf = _ours(model_dir, dtype=torch.bfloat16), _hf(model_dir, dtype=torch.bfloat16)
    assert ours.model.layers[0].input_layernorm.weight.dtype == torch.float32
    assert ours.model.embed_scale == float(torch.tensor(64 ** 0.5, dtype=torch.bfloat16))
    ids = _ids(24)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    got = _logits(ours, ids)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    fp32 = _logits(_ours(model_dir), ids)
    assert (got - fp32).abs().max() < 0.1 * fp32.abs().max()


def test_gemma_norm_matches_transformers():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from pagedllm.layers.layernorm import GemmaRMSNorm
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        ref = Gemma3RMSNorm(64, eps=1e-6).to(dtype)
        ref.weight.data.normal_()
        torch.set_default_dtype(dtype)
        try:
            ours = GemmaRMSNorm(64, eps=1e-6)
        finally:
            torch.set_default_dtype(torch.float32)
        ours.weight.weight_loader(ours.weight, ref.weight.data)
        x, residual = torch.randn(7, 64, dtype=dtype), torch.randn(7, 64, dtype=dtype)
        with torch.no_grad():
            assert torch.equal(ours.forward_native(x), ref(x))
            torch.testing.assert_close(ours(x), ref(x))
            out, new_residual = ours(x, residual)
            assert torch.equal(new_residual, x + residual)
            torch.testing.assert_close(out, ref(x + residual))


def test_bidirectional_gemma3_is_refused(tmp_path):
    from tests.conftest import save_tiny_model, tiny_hf_config
    config = tiny_hf_config("gemma3")
    config.use_bidirectional_attention = True
    model_dir = save_tiny_model(str(tmp_path), config)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True .* not supported"):
        _ours(model_dir)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_partial_rotary_outside_phi3_is_refused(arch):
    """transformers' Llama / Qwen3 / Gemma 3 rotate every head dimension whatever partial_rotary_factor says (their
    scaled ropes crash on it); rotating part of each head gave other logits. Phi-3 applies it
    (test_phi3_longrope_and_partial_rotary)."""
    from pagedllm.models.registry import get_model_class
    from tests.conftest import tiny_hf_config
    config = tiny_hf_config(arch)
    config.num_hidden_layers = 1
    config.partial_rotary_factor = 0.5
    if isinstance(config.rope_parameters, dict) and "rope_theta" in config.rope_parameters:
        config.rope_parameters["partial_rotary_factor"] = 0.5  # where transformers 5 keeps it
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported"):
        get_model_class(config)(config, torch.float32)


def test_phi3_odd_rotary_dimension_is_refused(tmp_path):
    """Phi-3 with head_dim 36 x partial_rotary_factor 0.75 = 27 rotated dimensions: transformers serves it (14
    frequencies computed for 27, 28 dimensions rotated), pagedllm failed on a bare AssertionError; it is refused in a
    sentence naming the product."""
    from tests.conftest import save_tiny_model, tiny_hf_config
    config = tiny_hf_config("phi3_plain")
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 72, 2, 2
    config.rope_parameters["partial_rotary_factor"] = 0.75
    model_dir = save_tiny_model(str(tmp_path), config)
    with pytest.raises(ValueError, match=r"rotary dimension of 27 \(head_dim 36 x partial_rotary_factor 0.75\)"):
        _ours(model_dir)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_past_the_window_matches_transformers(tmp_path, arch):
    """A 16-token window and 60-token prompts: the local layers see only their window (Gemma 2's with capped
    logits), the global ones everything."""
    from tests.conftest import save_tiny_model, tiny_hf_config
    config = tiny_hf_config(arch)
    config.sliding_window = 16
    ours = check_against_hf(save_tiny_model(str(tmp_path), config), 60)
    assert {a.sliding_window for a in ours.attn_layers} == {16, None}


@pytest.mark.parametrize("tie", [None, False], ids=["tied", "untied-at-top"])
def test_gemma3_conditional_generation_serves_its_text_model(tmp_path, caplog, tiny_model_dir, tie):
    """A multimodal Gemma 3 checkpoint (a tiny SigLIP tower, language model = the tiny gemma3): pagedllm builds the
    text model from text_config, reads the language model's tensors under their saved names, skips the vision
    tower's, and gives transformers' Gemma3ForConditionalGeneration logits on a text-only prompt; with
    tie_word_embeddings false at the top level (the text config's default: true) its own lm_head, as transformers
    unties by the top-level flag."""
    from tests.models.family_configs import save_tiny_gemma3_multimodal
    hf = save_tiny_gemma3_multimodal(str(tmp_path), tie)
    served = load_hf_config(str(tmp_path))
    assert served.architectures == ["Gemma3ForConditionalGeneration"] and served.vocab_size == 512
    ours = _ours(str(tmp_path))
    assert type(ours).__name__ == "Gemma3ForConditionalGeneration" and len(ours.attn_layers) == 6
    assert not [r for r in caplog.records if "Ignoring" in r.getMessage()]  # the vision tower: skipped quietly
    assert not [r for r in caplog.records if "tie_word_embeddings" in r.getMessage()]  # untied as the config says
    ids = _ids(40)
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    torch.testing.assert_close(_logits(ours, ids), ref, atol=ATOL, rtol=1e-4)


def test_gemma3_conditional_generation_eos_ids_are_the_checkpoints(tmp_path):
    """Gemma 3 4B's config.json states eos_token_id [1, 106] at the top level and none in text_config (whose
    default is 1). transformers' generation config (what vLLM reads without a generation_config.json) takes the
    top level's ids; the served text config kept its default, so <end_of_turn> (106) did not stop generation."""
    import json

    from transformers import AutoConfig, GenerationConfig

    from pagedllm.worker.worker import read_eos_token_ids
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
           "bos_token_id": 2, "pad_token_id": 0,
           "text_config": {"hidden_size": 64, "intermediate_size": 128, "model_type": "gemma3_text",
                           "num_hidden_layers": 2, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 16},
           "vision_config": {"hidden_size": 32, "intermediate_size": 64, "model_type": "siglip_vision_model",
                             "num_attention_heads": 2, "num_hidden_layers": 1, "image_size": 28, "patch_size": 14}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    reference = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(tmp_path)))
    served = load_hf_config(str(tmp_path))
    assert read_eos_token_ids(served, str(tmp_path)) == reference.eos_token_id == [1, 106]
    assert (served.bos_token_id, served.pad_token_id) == (reference.bos_token_id, reference.pad_token_id)



def test_gemma3_conditional_generation_dtype_is_the_checkpoints(tmp_path):
    """A multimodal Gemma 3 checkpoint states its dtype at the top level (text_config has none); the served text
    config takes it, so dtype "auto" on a GPU keeps a float16 checkpoint in float16 (it fell back to bfloat16)."""
    import json

    import torch

    from pagedllm.worker.worker import resolve_dtype
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "float16",
           "text_config": {"hidden_size": 64, "intermediate_size": 128, "model_type": "gemma3_text",
                           "num_hidden_layers": 2},
           "vision_config": {"hidden_size": 32, "intermediate_size": 64, "model_type": "siglip_vision_model",
                             "num_attention_heads": 2, "num_hidden_layers": 1, "image_size": 28, "patch_size": 14}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    served = load_hf_config(str(tmp_path))
    assert resolve_dtype("auto", served, torch.device("cuda")) == torch.float16  # (reads the config only)
    raw["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert resolve_dtype("auto", load_hf_config(str(tmp_path)), torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("override", [
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    {"rope_theta": 5e5},
    {"rope_local_base_freq": 300.0},
    {"rope_scaling": {"rope_type": "linear", "factor": 3.0}, "rope_theta": 2e5, "rope_local_base_freq": 50.0},
], ids=["yarn", "theta", "local-base", "all"])
def test_gemma3_rope_overrides_go_to_their_layer_type(tmp_path, tiny_model_dir, override):
    """hf_overrides of Gemma 3's rope, whose parameters are per layer type: a flat rope_scaling replaced both types'
    (the global base fell to 10 000, the local rope to its default), rope_theta / rope_local_base_freq were set where
    nothing reads them. Each now goes where transformers puts the same key of a config.json (the scaling and
    rope_theta: the global layers', the scaling over their base; rope_local_base_freq: the local layers'): logits
    equal transformers' model of such a config.json, with the same weights."""
    import json
    import os
    import shutil

    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("gemma3")
    legacy = str(tmp_path / "legacy")
    shutil.copytree(model_dir, legacy)
    with open(os.path.join(legacy, "config.json")) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    full = rope["full_attention"]
    config.update(rope_theta=full["rope_theta"], rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
                  rope_scaling={k: v for k, v in full.items() if k != "rope_theta"})
    config.update(override)
    if "rope_scaling" in override and "rope_theta" not in override:
        config["rope_theta"] = full["rope_theta"]  # the model's own base under the new scaling
    with open(os.path.join(legacy, "config.json"), "w") as f:
        json.dump(config, f)
    hf = AutoModelForCausalLM.from_pretrained(legacy, dtype=torch.float32, attn_implementation="eager").eval()
    ours = get_model(load_hf_config(model_dir, overrides=override), model_dir, dtype=torch.float32, device="cpu")
    assert ours.config.rope_parameters == hf.config.rope_parameters
    ids = _ids(48)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(_logits(ours, ids), ref, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("scaled", ["full_attention", "sliding_attention"])
def test_gemma3_longrope_on_one_layer_type(tmp_path, scaled):
    """LongRoPE on one of Gemma 3's layer types (its rope parameters are per type). The model mapped the positions
    through its global embedding only: with the global one scaled, the local layers read their table at the long
    rows' offset (past its end: "position outside the cos/sin cache"); with the local one scaled, its long rows were
    never read (the short factors past the original context). Each embedding now maps the positions its own layers
    read: logits equal transformers' in a plain forward, and the engine's greedy tokens and logprobs its generate's
    for prompts within and past the original context (32) in one batch."""
    from pagedllm import LLM, SamplingParams
    from tests.conftest import save_tiny_model, tiny_hf_config

    config = tiny_hf_config("gemma3")
    other = "sliding_attention" if scaled == "full_attention" else "full_attention"
    config.rope_parameters = {
        scaled: {"rope_type": "longrope", "rope_theta": 10_000.0, "original_max_position_embeddings": 32,
                 "short_factor": [1.0 + 0.05 * i for i in range(16)], "long_factor": [1.5 + i for i in range(16)]},
        other: {"rope_type": "default", "rope_theta": 1_000.0}}
    model_dir = save_tiny_model(str(tmp_path), config)
    hf, ours = _hf(model_dir), _ours(model_dir)
    ids = _ids(48)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(_logits(ours, ids), ref, atol=ATOL, rtol=1e-4)

    prompts = [_ids(5, seed=2).tolist(), ids.tolist()]
    with torch.inference_mode():
        gens = [hf.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, output_logits=True,
                            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0) for p in prompts]
    with LLM(model=model_dir, dtype="float32", device="cpu", max_num_batched_tokens=16, max_num_seqs=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0), use_tqdm=False)
    for gen, prompt, out in zip(gens, prompts, outs):
        tokens = gen.sequences[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == tokens
        want = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(gen.logits, tokens)]
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
        assert got == pytest.approx(want, abs=1e-3)


@pytest.mark.parametrize("other,message", [
    ({"rope_type": "longrope", "rope_theta": 1_000.0, "original_max_position_embeddings": 64,
      "short_factor": [1.0] * 16, "long_factor": [2.0] * 16},
     r"LongRoPE with different original contexts on different layers \(\[32, 64\].*--max-model-len to 64"),
    ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1_000.0},
     r"LongRoPE on some layers and dynamic NTK rope on others .*--max-model-len to 128"),
], ids=["two-originals", "longrope-and-dynamic"])
def test_gemma3_rope_offsets_of_two_kinds_are_refused(tmp_path, monkeypatch, other, message):
    """The engine gives a request one LongRoPE choice (long or short rows, by one original context) and one
    offsets buffer per step: Gemma 3 layer types scaled by LongRoPE around two original contexts, or LongRoPE and
    dynamic NTK, read the wrong rows on some layers (silently other logits than transformers'). Such a model is
    refused at start while its context needs both; within the suggested --max-model-len it serves."""
    from pagedllm import LLM
    from tests.conftest import save_tiny_model, tiny_hf_config

    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    config = tiny_hf_config("gemma3")
    config.max_position_embeddings = 128
    config.rope_parameters = {
        "full_attention": {"rope_type": "longrope", "rope_theta": 10_000.0, "original_max_position_embeddings": 32,
                           "short_factor": [1.0] * 16, "long_factor": [1.5] * 16},
        "sliding_attention": other}
    model_dir = save_tiny_model(str(tmp_path), config)
    with pytest.raises(ValueError, match=message):
        LLM(model=model_dir, dtype="float32", device="cpu", max_model_len=256)
    with LLM(model=model_dir, dtype="float32", device="cpu", max_model_len=64 if other["rope_type"] == "longrope"
             else 128) as llm:
        assert llm.engine.worker.runner.long_rope_original == 32
