"""Checkpoint tensors against the model's parameters: a tensor nothing reads is warned about once (known-harmless
extras quietly skipped), a parameter no tensor fills is an error naming it, and every family's own checkpoint
loads without a word."""
from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch

from pagedllm.models.loader import get_model, load_hf_config
from tests.models.moe_helpers import MOE_ARCHS, tiny_moe_dir  # noqa: F401

DENSE_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi3_plain")


@pytest.fixture(autouse=True)
def _pagedllm_logs_reach_caplog(monkeypatch):
    # (the API server's logging setup stops propagation; an in-process server would hide every record here)
    monkeypatch.setattr(logging.getLogger("pagedllm"), "propagate", True)


def _load(model_dir: str, **kwargs):
    return get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu", **kwargs)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids))))


def _pagedllm_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("pagedllm") and r.levelno >= logging.WARNING]


def _rewrite(tmp_path, source: str, edit, config_edit=None) -> str:
    """A copy of `source` whose single safetensors file is `edit(tensors)` (config.json through `config_edit`)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "edited"
    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if config_edit is not None:
        config = json.loads((out / "config.json").read_text())
        config_edit(config)
        (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize("tie", [None, True, False])
@pytest.mark.parametrize("arch", DENSE_ARCHS)
def test_every_family_loads_its_own_checkpoint_without_warnings(caplog, tiny_model_dir, arch, tie):
    """Guards the warning against false alarms: transformers' own save of each family (tied or not)."""
    caplog.set_level(logging.DEBUG, logger="pagedllm")
    _load(tiny_model_dir(arch, tie_word_embeddings=tie))
    assert _pagedllm_warnings(caplog) == []


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_every_moe_family_loads_its_own_checkpoint_without_warnings(caplog, tiny_moe_dir, arch):
    caplog.set_level(logging.DEBUG, logger="pagedllm")
    _load(tiny_moe_dir(arch))
    assert _pagedllm_warnings(caplog) == []


def test_unknown_tensors_are_warned_about_once_and_the_model_still_loads(tmp_path, caplog, tiny_llama_dir):
    def add(tensors):
        tensors["score.weight"] = torch.randn(3, 64)  # a classification fine-tune's head
        tensors["model.layers.0.mlp.extra_proj.weight"] = torch.randn(8, 64)
        tensors["model.layers.1.self_attn.o_proj.bias"] = torch.ones(64)  # a bias the model (and HF's) lacks

    edited = _rewrite(tmp_path, tiny_llama_dir, add)
    caplog.set_level(logging.WARNING, logger="pagedllm")
    model = _load(edited)
    warnings = _pagedllm_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "Ignoring 3 checkpoint tensor(s) with no matching parameter" in warnings[0]
    for name in ("score.weight", "model.layers.0.mlp.extra_proj.weight", "model.layers.1.self_attn.o_proj.bias"):
        assert name in warnings[0]
    ids = torch.arange(3, 20)
    torch.testing.assert_close(_logits(model, ids), _logits(_load(tiny_llama_dir), ids), atol=0, rtol=0)


def test_the_warning_names_the_first_few_of_many(tmp_path, caplog, tiny_llama_dir):
    edited = _rewrite(tmp_path, tiny_llama_dir,
                      lambda t: t.update({f"extra_head.{i}.weight": torch.randn(2, 2) for i in range(12)}))
    caplog.set_level(logging.WARNING, logger="pagedllm")
    _load(edited)
    (warning,) = _pagedllm_warnings(caplog)
    assert "Ignoring 12 checkpoint tensor(s)" in warning and "(and 7 more)" in warning


def test_more_layers_than_the_config_says_are_warned_about(tmp_path, caplog, tiny_llama_dir):
    def one_layer(config):
        config["num_hidden_layers"] = 1

    caplog.set_level(logging.WARNING, logger="pagedllm")
    _load(_rewrite(tmp_path, tiny_llama_dir, lambda t: None, one_layer))
    (warning,) = _pagedllm_warnings(caplog)
    assert "Ignoring 9 checkpoint tensor(s)" in warning and "model.layers.1." in warning


def test_known_harmless_extras_are_quiet(tmp_path, caplog, tiny_model_dir):
    """rope's inv_freq, a tied checkpoint's lm_head copy, MTP heads (named, or numbered after the decoder layers
    where the config declares them) and an all-zero bias (GPTQ exporters) load without a warning."""
    source = tiny_model_dir("qwen2", tie_word_embeddings=True)

    def add(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        for i in range(2):
            tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
        tensors["mtp.fc.weight"] = torch.randn(64, 128)
        tensors["model.mtp_layers.0.input_layernorm.weight"] = torch.randn(64)
        tensors["model.layers.2.eh_proj.weight"] = torch.randn(64, 128)  # layer 2 of 2: the MTP layer
        tensors["model.layers.0.mlp.down_proj.bias"] = torch.zeros(64)

    edited = _rewrite(tmp_path, source, add, lambda c: c.update(num_nextn_predict_layers=1))
    caplog.set_level(logging.DEBUG, logger="pagedllm")
    model = _load(edited)
    assert _pagedllm_warnings(caplog) == []
    assert any("Skipping 4 checkpoint tensor(s) the model does not use" in r.getMessage() for r in caplog.records)
    ids = torch.arange(3, 20)
    torch.testing.assert_close(_logits(model, ids), _logits(_load(source), ids), atol=0, rtol=0)


def test_a_layer_after_the_decoder_is_warned_about_without_mtp_in_the_config(tmp_path, caplog, tiny_qwen2_dir):
    edited = _rewrite(tmp_path, tiny_qwen2_dir, lambda t: t.update({"model.layers.2.eh_proj.weight": torch.ones(2)}))
    caplog.set_level(logging.WARNING, logger="pagedllm")
    _load(edited)
    (warning,) = _pagedllm_warnings(caplog)
    assert "model.layers.2.eh_proj.weight" in warning


@pytest.mark.parametrize("dropped,named", [
    ("model.norm.weight", r"model\.norm\.weight"),
    ("lm_head.weight", r"lm_head\.weight"),  # untied: no head to fall back on
    ("model.layers.1.self_attn.v_proj.weight", r"model\.layers\.1\.self_attn\.qkv_proj\.weight"),
    ("model.layers.0.mlp.up_proj.weight", r"model\.layers\.0\.mlp\.gate_up_proj\.weight"),
])
def test_a_missing_tensor_is_an_error_naming_it(tmp_path, tiny_llama_dir, dropped, named):
    edited = _rewrite(tmp_path, tiny_llama_dir, lambda t: t.pop(dropped))
    with pytest.raises(ValueError, match=rf"missing 1 weight\(s\) the model needs: {named}\."):
        _load(edited)


def test_a_missing_qkv_bias_is_an_error(tmp_path, tiny_qwen2_dir):
    edited = _rewrite(tmp_path, tiny_qwen2_dir, lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\).*model\.layers\.0\.self_attn\.qkv_proj\.bias"):
        _load(edited)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "phi3_plain"])
def test_bias_flags_the_family_ignores_expect_no_bias_tensors(tmp_path, tiny_model_dir, arch):
    """transformers builds Mistral / Phi-3 without projection biases and every family but Llama without MLP biases,
    whatever attention_bias / mlp_bias say: such a config.json loads there (no bias tensors) and gives the same
    logits here (was: 'missing ... bias' errors)."""
    source = tiny_model_dir(arch)
    flags = {"mlp_bias": True} if arch.startswith("qwen") else {"attention_bias": True, "mlp_bias": True}
    edited = _rewrite(tmp_path, source, lambda t: None, lambda c: c.update(flags))
    ids = torch.arange(3, 20)
    torch.testing.assert_close(_logits(_load(edited), ids), _logits(_load(source), ids), atol=0, rtol=0)


def test_dummy_weights_need_no_tensors(caplog, tiny_llama_dir):
    caplog.set_level(logging.WARNING, logger="pagedllm")
    _load(tiny_llama_dir, load_format="dummy")
    assert _pagedllm_warnings(caplog) == []


def test_unknown_moe_tensors_are_warned_about(tmp_path, caplog, tiny_moe_dir):
    """An expert past the config's count is a shape error; a per-expert tensor of a dense layer (qwen3_moe's
    layer 1) matches nothing and is warned about."""
    source = tiny_moe_dir("qwen3_moe")
    edited = _rewrite(tmp_path, source,
                      lambda t: t.update({"model.layers.1.mlp.experts.0.up_proj.weight": torch.randn(48, 64)}))
    caplog.set_level(logging.WARNING, logger="pagedllm")
    _load(edited)
    (warning,) = _pagedllm_warnings(caplog)
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in warning


def test_gguf_tensors_without_a_name_are_warned_about(tmp_path, fresh_cache, caplog, tiny_model_dir):
    """On every load of the file (the conversion is cached), on both paths: the float one from the converted
    directory and the packed CPU loader that reads the file itself; once each."""
    from pagedllm.models.gguf_packed import iter_gguf_weights
    from pagedllm.models.loader import prepare_model_dir
    from tests.models.gguf_writer import write_tiny_gguf

    path = str(tmp_path / "tiny.gguf")
    extra = {"blk.0.attn_sinks.weight": np.ones(4, dtype=np.float32),
             "blk.1.nextn.eh_proj.weight": np.ones((2, 2), dtype=np.float32)}  # an MTP head: quiet
    write_tiny_gguf(tiny_model_dir("qwen2"), path, "qwen2", extra=extra)
    converted = prepare_model_dir(path)
    for _ in range(2):  # the second load: from the cached conversion
        caplog.clear()
        caplog.set_level(logging.WARNING, logger="pagedllm")
        _load(prepare_model_dir(path))
        (warning,) = [w for w in _pagedllm_warnings(caplog) if "GGUF" in w]
        assert "Ignoring 1 GGUF tensor(s)" in warning and "blk.0.attn_sinks.weight" in warning
    caplog.clear()
    names = [name for name, _ in iter_gguf_weights(path, load_hf_config(converted), lambda name, qtype: False,
                                                   show_progress=False)]
    assert "model.embed_tokens.weight" in names
    (warning,) = _pagedllm_warnings(caplog)
    assert "Ignoring 1 GGUF tensor(s)" in warning and "blk.0.attn_sinks.weight" in warning


def test_stage_weights_hands_layers_past_the_last_to_the_last_stage(monkeypatch):
    """With pipeline stages a layer no stage holds reaches the last stage's loader (which warns) rather than
    being dropped by every stage."""
    import types

    from pagedllm.distributed import pipeline

    model = types.SimpleNamespace(model=types.SimpleNamespace(start_layer=1, end_layer=2), tie_word_embeddings=False,
                                  config=types.SimpleNamespace(num_hidden_layers=2))
    weights = [(f"model.layers.{i}.mlp.down_proj.weight", None) for i in range(3)] + [("lm_head.weight", None)]
    for last, expected in ((True, {1, 2}), (False, {1})):
        group = types.SimpleNamespace(world_size=2, is_first_rank=False, is_last_rank=last)
        monkeypatch.setattr(pipeline, "get_pp_group", lambda group=group: group)
        names = [n for n, _ in pipeline.stage_weights(model, weights)]
        assert {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")} == expected


def test_a_gguf_rope_scaling_type_not_implemented_is_refused(tmp_path, fresh_cache, tiny_model_dir):
    """Plain rope in its place would quietly degrade every prompt past the original context (it was a warning)."""
    import gguf

    from pagedllm.models.loader import prepare_model_dir
    from tests.models.gguf_writer import write_tiny_gguf

    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_model_dir("qwen2"), path, "qwen2",
                    identity={"rope_scaling_type": gguf.RopeScalingType.LONGROPE, "rope_scaling_factor": 4.0})
    with pytest.raises(ValueError, match=r"rope scaling type 'longrope' \(qwen2\.rope\.scaling\.type\) is not "
                                         r"supported"):
        prepare_model_dir(path)


def _hf_logits(model_dir: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


def test_a_tied_config_with_a_different_lm_head_is_untied_as_transformers_does(tmp_path, caplog, tiny_model_dir):
    """A fine-tune that trained its head apart but kept tie_word_embeddings: transformers warns and does not tie;
    tying anyway (the head skipped) would silently serve the embedding as the head."""
    source = tiny_model_dir("qwen2", tie_word_embeddings=True)
    edited = _rewrite(tmp_path, source, lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"] + 0.05 * torch.randn_like(t["model.embed_tokens.weight"])}))
    caplog.set_level(logging.WARNING, logger="pagedllm")
    model = _load(edited)
    (warning,) = _pagedllm_warnings(caplog)
    assert "lm_head.weight differs from model.embed_tokens.weight" in warning
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    ids = torch.arange(3, 30)
    torch.testing.assert_close(_logits(model, ids), _hf_logits(edited, ids), atol=1e-4, rtol=1e-4)
    from safetensors.torch import load_file
    assert "lm_head.weight" in model.load_weights(load_file(os.path.join(edited, "model.safetensors")).items())


def test_a_tied_checkpoint_holding_only_the_head_loads_it_as_the_embedding(tmp_path, caplog, tiny_model_dir):
    source = tiny_model_dir("qwen2", tie_word_embeddings=True)
    edited = _rewrite(tmp_path, source, lambda t: t.update({"lm_head.weight": t.pop("model.embed_tokens.weight")}))
    caplog.set_level(logging.WARNING, logger="pagedllm")
    model = _load(edited)
    assert _pagedllm_warnings(caplog) == []
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.arange(3, 30)
    torch.testing.assert_close(_logits(model, ids), _logits(_load(source), ids), atol=0, rtol=0)
