"""compressed-tensors checkpoints written by the compressed-tensors library: our loader + CPU path against
transformers with the library's decompressed weights (and the library's activation fake-quantization for W8A8)."""
from __future__ import annotations

import os

import pytest
import torch

from pagedllm.models.loader import load_model
from tests.quantization.checkpoints import ct_checkpoint

PROMPT = torch.randint(2, 512, (40,), generator=torch.Generator().manual_seed(13))


def _compare(model_dir, reference, atol):
    ours, _, _ = load_model(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        got = ours.compute_logits(ours(PROMPT, torch.arange(len(PROMPT))))
        want = reference(PROMPT[None]).logits[0]
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-3)
    return ours


@pytest.mark.parametrize("arch,preset,args,method", [
    ("llama", "W4A16", {"group_size": 32}, "CTWNA16Method"),
    ("qwen3", "W4A16_ASYM", {"group_size": 32}, "CTWNA16Method"),
    ("qwen2", "W8A16", {"group_size": 32}, "CTWNA16Method"),
    ("llama", "W8A16", {"strategy": "channel", "group_size": None}, "CTWNA16Method"),
    ("qwen3", "W4A16", {"group_size": 32, "actorder": "weight"}, "CTWNA16Method"),
])
def test_weight_only_schemes(tmp_path, caplog, tiny_model_dir, arch, preset, args, method):
    model_dir, reference = ct_checkpoint(tiny_model_dir(arch), str(tmp_path / "ct"), preset, **args)
    ours = _compare(model_dir, reference, atol=2e-4)
    assert not [r for r in caplog.records if "Ignoring" in r.getMessage()]  # every tensor read (or known skipped)
    assert type(ours.model.layers[1].self_attn.qkv_proj.linear_method).__name__ == method


@pytest.mark.parametrize("arch,preset", [("llama", "FP8_DYNAMIC"), ("qwen2", "FP8"), ("qwen3", "W8A8"),
                                         ("phi3_plain", "FP8")])
def test_w8a8_schemes(tmp_path, caplog, tiny_model_dir, arch, preset):
    # FP8_DYNAMIC: per-channel weights, dynamic per-token activations; FP8: per-tensor weights (one scale per
    # fused shard) and a static input scale; W8A8: INT8 per-channel weights, per-token int8 activations.
    # Phi-3 + FP8: one weight / input scale for a whole checkpoint-fused qkv_proj / gate_up_proj (was refused: "the
    # checkpoint has (1,), the model expects (3,)").
    model_dir, reference = ct_checkpoint(tiny_model_dir(arch), str(tmp_path / "ct"), preset)
    ours, _, _ = load_model(model_dir, dtype=torch.float32)
    assert not [r for r in caplog.records if "Ignoring" in r.getMessage()]  # weight / input scales all read
    assert ours.model.layers[0].mlp.down_proj.weight.dtype == (torch.int8 if preset == "W8A8"
                                                               else torch.float8_e4m3fn)
    with torch.inference_mode():
        got = ours.compute_logits(ours(PROMPT, torch.arange(len(PROMPT))))
        want = reference(PROMPT[None]).logits[0]
        for hook in reference.act_quant_hooks:
            hook.remove()
        weight_only = reference(PROMPT[None]).logits[0]
    # Activation quantization makes results sensitive to last-bit differences upstream (a value on a rounding
    # boundary flips one step). So: close to the library's W8A8 arithmetic, and far closer to it than to the
    # weight-only result of the same weights (which shows the activations really are quantized).
    err, err_weight_only = (got - want).abs().mean(), (got - weight_only).abs().mean()
    assert (got - want).abs().max() < 0.05 and err < 1e-3, (err, (got - want).abs().max())
    assert err < 0.2 * err_weight_only, (err, err_weight_only)


@pytest.mark.parametrize("preset,dtype", [("FP8_DYNAMIC", torch.bfloat16), ("W8A8", torch.float16),
                                          ("W8A8", torch.float32)])
def test_w8a8_linear_matches_library_quantization(tmp_path, tiny_model_dir, preset, dtype):
    """One linear layer in the activation dtype users run (bf16 / fp16): far closer to the library's W8A8
    arithmetic than to the weight-only product of the same weights, at 1, 4 and 40 rows."""
    from pagedllm.models.loader import get_model, load_hf_config
    from pagedllm.quantization import resolve_quant_config
    from tests.quantization.checkpoints import w8a8_layer_errors

    model_dir, reference = ct_checkpoint(tiny_model_dir("llama"), str(tmp_path / "ct"), preset)
    cfg = load_hf_config(model_dir)
    ours = get_model(cfg, model_dir, dtype=dtype, device="cpu", quant_config=resolve_quant_config(None, cfg, model_dir))
    for rows in (1, 4, 40):
        err, contrast, scale = w8a8_layer_errors(ours, reference, "model.layers.0.mlp.down_proj", dtype, "cpu", rows)
        assert err < 0.1 * contrast and err < 0.001 * scale, (preset, dtype, rows, err, contrast, scale)


@pytest.mark.parametrize("ignore,targets", [
    (("lm_head", "model.layers.0.self_attn.qkv_proj"), ("Linear",)),
    (("lm_head", "re:.*layers\\.1\\.mlp\\.gate_up_proj"), ("Linear",)),
    (("lm_head",), ("re:.*qkv_proj", "re:.*gate_up_proj", "re:.*down_proj")),  # o_proj left float
])
def test_phi3_names_its_fused_modules(tmp_path, caplog, tiny_model_dir, ignore, targets):
    """Phi-3 checkpoints store q/k/v as one qkv_proj and gate/up as one gate_up_proj, and so do the ignore lists and
    targets llmcompressor writes for them: the layer named is kept float (was: quantized anyway, so the load failed
    on its missing weight_packed) or quantized by the scheme that names it (was: left float)."""
    model_dir, reference = ct_checkpoint(tiny_model_dir("phi3_plain"), str(tmp_path / "ct"), "W4A16",
                                         ignore=ignore, targets=targets, group_size=32)
    ours = _compare(model_dir, reference, atol=2e-4)
    assert not [r for r in caplog.records if "Ignoring" in r.getMessage()]
    kinds = {name: type(m.linear_method).__name__ for name, m in ours.named_modules()
             if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}
    floats = {name for name, kind in kinds.items() if kind == "UnquantizedLinearMethod"}
    expected = {"model.layers.0.self_attn.qkv_proj"} if "model.layers.0.self_attn.qkv_proj" in ignore else \
        {"model.layers.1.mlp.gate_up_proj"} if len(ignore) == 2 else {f"model.layers.{i}.self_attn.o_proj"
                                                                       for i in range(2)}
    assert floats == expected and set(kinds.values()) == {"UnquantizedLinearMethod", "CTWNA16Method"}


# (the library writes the modules it left float into config.json, as language_model.model.layers.N...)
@pytest.mark.parametrize("ignored", [(), ("model.language_model.layers.0.mlp.down_proj",),
                                     ("re:.*language_model.layers.1.self_attn.*",)])
def test_gemma3_multimodal_checkpoint_serves_its_quantized_text_model(tmp_path, caplog, ignored):
    """A quantized multimodal Gemma 3 checkpoint states its quantization_config at the top level, not in the
    text_config the text model is built from: it was built unquantized and every load failed on "missing" float
    weights. Its ignore list names the language model's layers as the checkpoint does (language_model.model.*,
    model.language_model.*), not by the causal-LM names the layers have here: those layers stay float too."""
    from tests.models.family_configs import save_tiny_gemma3_multimodal

    save_tiny_gemma3_multimodal(str(tmp_path / "src"))
    ignore = ("lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*") + ignored
    model_dir, reference = ct_checkpoint(str(tmp_path / "src"), str(tmp_path / "ct"), "W4A16", ignore=ignore,
                                         group_size=32)
    ours = _compare(model_dir, reference, atol=2e-4)
    assert type(ours).__name__ == "Gemma3ForConditionalGeneration"
    assert type(ours.quant_config).__name__ == "CompressedTensorsConfig"
    assert not [r for r in caplog.records if "Ignoring" in r.getMessage()]
    floats = {name for name, m in ours.named_modules()
              if type(getattr(m, "linear_method", None)).__name__ == "UnquantizedLinearMethod"}
    expected = {(): set(), "down_proj": {"model.layers.0.mlp.down_proj"},
                "self_attn": {"model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj"}}
    assert floats == expected[next((k for k in ("down_proj", "self_attn") if k in str(ignored)), ())]


@pytest.mark.parametrize("arch,more_targets,layer", [
    ("llama", ("re:.*down_proj",), "model.layers.0.mlp.down_proj"),  # a regex over the class target "Linear"
    ("qwen3", ("model.layers.1.self_attn.o_proj",), "model.layers.1.self_attn.o_proj"),  # an exact name
])
def test_the_most_specific_target_picks_the_scheme(tmp_path, caplog, tiny_model_dir, arch, more_targets, layer):
    """Mixed-precision checkpoints (W4A16 on every Linear, W8A16 on some layers named by a second group): the
    library gives a layer the scheme of its most specific target (exact name, then regex, then the class name),
    whatever the groups' order; pagedllm took the first group listing any matching target, so those layers got
    the W4 layout and their W8 tensors failed to load."""
    model_dir, reference = ct_checkpoint(tiny_model_dir(arch), str(tmp_path / "ct"), "W4A16", group_size=32,
                                         more_groups=(("W8A16", more_targets, {"group_size": 32}),))
    ours = _compare(model_dir, reference, atol=2e-4)
    assert not [r for r in caplog.records if "Ignoring" in r.getMessage()]
    bits = {name: m.linear_method.scheme.bits for name, m in ours.named_modules()
            if hasattr(getattr(m, "linear_method", None), "scheme")}
    eight = {name for name, b in bits.items() if b == 8}
    assert layer in eight and (len(eight) == 2 if "re:" in more_targets[0] else eight == {layer})


def test_gemma3_multimodal_target_naming_a_language_model_layer(tmp_path, caplog):
    """A second config group whose regex names a language-model layer as the checkpoint does: that layer takes its
    scheme (W8), not the class target's (W4) that the causal-LM name alone would match."""
    from tests.models.family_configs import save_tiny_gemma3_multimodal

    save_tiny_gemma3_multimodal(str(tmp_path / "src"))
    ignore = ("lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*")
    model_dir, reference = ct_checkpoint(str(tmp_path / "src"), str(tmp_path / "ct"), "W4A16", ignore=ignore,
                                         group_size=32, more_groups=(
                                             ("W8A16", ("re:.*language_model.*layers\\.2\\.mlp\\.down_proj",),
                                              {"group_size": 32}),))
    ours = _compare(model_dir, reference, atol=2e-4)
    assert not [r for r in caplog.records if "Ignoring" in r.getMessage()]
    bits = {name: m.linear_method.scheme.bits for name, m in ours.named_modules()
            if hasattr(getattr(m, "linear_method", None), "scheme")}
    assert {name for name, b in bits.items() if b == 8} == {"model.layers.2.mlp.down_proj"}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: tied embeddings
def test_a_quantized_lm_head_is_refused_by_name(tmp_path, tiny_model_dir, arch):
    """A checkpoint whose lm_head is quantized too (targets "Linear", nothing ignored): the untied model failed on a
    "missing lm_head.weight", the tied one silently served the float embedding instead of the checkpoint's head."""
    model_dir, _ = ct_checkpoint(tiny_model_dir(arch), str(tmp_path / "ct"), "W8A16", ignore=(), group_size=32,
                                 reference=False)
    with pytest.raises(ValueError, match=r"LM head is quantized \(lm_head\.weight_packed\).*lm_head in `ignore`"):
        load_model(model_dir, dtype=torch.float32)


def test_a_quantized_embedding_is_refused_by_name(tmp_path, tiny_model_dir):
    """The library quantizes the token embedding too when the targets name the class "Embedding": the load failed
    on "The checkpoint is missing 1 weight(s) the model needs: model.embed_tokens.weight", naming no cause."""
    model_dir, _ = ct_checkpoint(tiny_model_dir("llama"), str(tmp_path / "ct"), "W8A16",
                                 targets=("Linear", "Embedding"), group_size=32, reference=False)
    with pytest.raises(ValueError, match=r"token embedding is quantized \(model\.embed_tokens\.weight_packed\)"):
        load_model(model_dir, dtype=torch.float32)


@pytest.mark.parametrize("token", [False, True])
def test_a_quantized_score_head_is_refused_by_name(tmp_path, token):
    """A classifier quantized with its score head (targets "Linear", only lm_head ignored, as recipes write):
    refused naming the head, not "missing score.weight"."""
    from tests.conftest import save_tiny_classifier

    src = save_tiny_classifier(str(tmp_path / "src"), "qwen2", 3, token=token)
    model_dir, _ = ct_checkpoint(src, str(tmp_path / "ct"), "W8A16", group_size=32, reference=False)
    with pytest.raises(ValueError, match=r"classification head \(score\) is quantized \(score\.weight_packed\)"):
        load_model(model_dir, dtype=torch.float32)


def test_an_ignored_parent_module_keeps_its_targeted_children_quantized(tmp_path, tiny_model_dir):
    """compressed-tensors matches `ignore` against each module by exact name (or regex): an entry naming a parent
    (`model.layers.0.mlp`) leaves its Linear children to the targets, which quantize them. The library then writes
    the layers it left float (lm_head) into config.json; a config carrying the recipe's list as given (as a tool
    copying the recipe writes it) was read here as "every layer under the parent is float", and loading failed on
    their packed weights."""
    import json

    model_dir, reference = ct_checkpoint(tiny_model_dir("llama"), str(tmp_path / "ct"), "W4A16",
                                         ignore=("lm_head", "model.layers.0.mlp"), group_size=32)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["quantization_config"]["ignore"] == ["lm_head"]  # the library's own list: the float layers
    config["quantization_config"]["ignore"] = ["lm_head", "model.layers.0.mlp"]
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    ours = _compare(model_dir, reference, atol=2e-4)
    kinds = {name: type(m.linear_method).__name__ for name, m in ours.named_modules()
             if name.startswith("model.layers.0.mlp.") and hasattr(m, "linear_method")}
    assert set(kinds) == {"model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"}
    assert set(kinds.values()) == {"CTWNA16Method"}


@pytest.mark.parametrize("actorder", ["dynamic", True])
def test_group_actorder_aliases_read_the_g_idx(tmp_path, caplog, tiny_model_dir, actorder):
    """The library's "dynamic" actorder is its alias of "group" (and older versions wrote `true`): the checkpoint
    holds a weight_g_idx. Only the word "group" was read as act-order, so that g_idx was ignored with a warning and
    every layer's scales were applied to the wrong channels (silently wrong logits). The checkpoint here: a W4A16
    one given a permuted g_idx; the reference dequantizes it with the library's own unpacking."""
    import json

    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file, save_file

    from tests.quantization.checkpoints import SAME_INPUT, reference_model

    src = tiny_model_dir("llama")
    model_dir, _ = ct_checkpoint(src, str(tmp_path / "ct"), "W4A16", group_size=32, reference=False)
    path = os.path.join(model_dir, "model.safetensors")
    tensors, dense, perms = load_file(path), {}, {}
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        module = name[: -len(".weight_packed")]
        scale = tensors[f"{module}.weight_scale"].float()
        k = int(tensors[f"{module}.weight_shape"][1])
        q = unpack_from_int32(tensors[name], 4, torch.Size((scale.shape[0], k))).float()  # signed values
        key = (module.split(".")[2], SAME_INPUT[module.rsplit(".", 1)[1]])  # fused layers share one input's order
        g_idx = (torch.arange(k) // 32)[perms.setdefault(key, torch.randperm(k, generator=gen))]
        tensors[f"{module}.weight_g_idx"] = g_idx.to(torch.int32)
        dense[module] = q * scale[:, g_idx]
    save_file(tensors, path)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = actorder
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    ours = _compare(model_dir, reference_model(src, dense, half_rest={}), atol=2e-4)
    assert not [r for r in caplog.records if "Ignoring" in r.getMessage()]
    assert ours.model.layers[0].mlp.down_proj.g_idx is not None


def test_an_unknown_actorder_is_refused_by_name():
    from pagedllm.quantization.compressed_tensors import CompressedTensorsConfig

    weights = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "actorder": "sideways"}
    with pytest.raises(ValueError, match=r"group 'g': weights actorder 'sideways' is not supported"):
        CompressedTensorsConfig.from_config({"format": "pack-quantized",
                                             "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}})


def test_an_unset_g_idx_means_column_order(tmp_path, caplog, tiny_model_dir):
    """An act-order checkpoint's weight_g_idx of -1 (the library's "no order set", its initial value, which a layer
    quantized without act-order calibration keeps): the library dequantizes such a layer in column order. The -1
    indexed the scales from the end, so every input channel took the last group's scale (silently wrong logits)."""
    import json

    from safetensors.torch import load_file, save_file

    model_dir, reference = ct_checkpoint(tiny_model_dir("llama"), str(tmp_path / "ct"), "W4A16", group_size=32)
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        k = int(tensors[name.replace(".weight_packed", ".weight_shape")][1])
        tensors[name.replace(".weight_packed", ".weight_g_idx")] = torch.full((k,), -1, dtype=torch.int32)
    save_file(tensors, path)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    ours = _compare(model_dir, reference, atol=2e-4)
    assert not [r for r in caplog.records if "Ignoring" in r.getMessage()]
    assert ours.model.layers[0].mlp.down_proj.g_idx is None
