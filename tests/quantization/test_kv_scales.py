"""FP8 KV-cache scales (layers/kv_cache_scales.py): read from a checkpoint under the exporters' names, else
calibrated from the first step's K/V (the default; PAGEDLLM_KV_SCALES=0 leaves the cache unscaled)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.kv_cache_scales import K_AMAX_TARGET, V_AMAX_TARGET, calibrated_scales, checkpoint_kv_scale


def test_checkpoint_names():
    attn = "model.layers.3.self_attn.attn"
    assert checkpoint_kv_scale("model.layers.3.self_attn.k_scale") == (attn, "k")
    assert checkpoint_kv_scale("model.layers.3.self_attn.v_scale") == (attn, "v")
    assert checkpoint_kv_scale("model.layers.3.self_attn.k_proj.output_scale") == (attn, "k")
    assert checkpoint_kv_scale("model.layers.3.self_attn.v_proj.output_scale") == (attn, "v")
    assert checkpoint_kv_scale("model.layers.3.self_attn.v_proj.v_scale") == (attn, "v")
    assert checkpoint_kv_scale("model.layers.3.self_attn.kv_scale") == (attn, "kv")
    assert checkpoint_kv_scale("model.layers.3.self_attn.q_proj.output_scale") == (attn, "q")
    for other in ("model.layers.3.self_attn.k_proj.weight_scale", "model.layers.3.self_attn.k_proj.input_scale",
                  "model.layers.3.self_attn.o_proj.output_scale", "model.layers.3.mlp.down_proj.weight_scale"):
        assert checkpoint_kv_scale(other) is None, other


def test_calibrated_scales_map_amax_to_targets():
    k = torch.randn(40, 2, 16) * 3
    v = torch.randn(40, 2, 16) * 0.01
    scales = calibrated_scales(k, v)
    torch.testing.assert_close(scales, torch.stack([k.abs().amax() / K_AMAX_TARGET, v.abs().amax() / V_AMAX_TARGET]))
    assert (v / scales[1]).abs().amax() == pytest.approx(V_AMAX_TARGET)


def _attn_layers(llm):
    return llm.engine.worker.runner.model.attn_layers


def test_engine_calibrates_on_first_step(tiny_llama_dir, caplog, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_KV_SCALES", raising=False)  # the default: scaled
    caplog.set_level("INFO", logger="pagedllm")
    llm = LLM(model=tiny_llama_dir, kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 20, max_model_len=256)
    layers = _attn_layers(llm)
    assert all(layer.kv_scale_source == "pending" for layer in layers)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([[5, 6, 7, 8, 9, 10]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert all(layer.kv_scale_source == "calibrated" for layer in layers)
    scales = torch.stack([layer.kv_scales for layer in layers])
    assert (scales > 0).all() and (scales != 1.0).all(), scales
    assert any("FP8 KV cache scales from the first step" in r.getMessage() for r in caplog.records)
    # Later requests keep the first step's scales (the cache already holds K / k_scale).
    again = llm.generate([[5, 6, 7, 8, 9, 10]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert torch.equal(torch.stack([layer.kv_scales for layer in layers]), scales)
    assert again == first
    full = LLM(model=tiny_llama_dir, kv_cache_memory_bytes=1 << 20, max_model_len=256)
    ref = full.generate([[5, 6, 7, 8, 9, 10]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert ref[:4] == first[:4], (ref, first)
    monkeypatch.setenv("PAGEDLLM_KV_SCALES", "0")  # unscaled, as before the scales existed
    plain = LLM(model=tiny_llama_dir, kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 20, max_model_len=256)
    plain.generate([[5, 6, 7]], params, use_tqdm=False)
    assert all(layer.kv_scale_source is None and torch.equal(layer.kv_scales, torch.ones(2))
               for layer in _attn_layers(plain))


def test_checkpoint_scales_are_loaded(tiny_llama_dir, tmp_path, caplog, monkeypatch):
    from safetensors.torch import load_file, save_file

    monkeypatch.delenv("PAGEDLLM_KV_SCALES", raising=False)  # the default: scaled
    dst = str(tmp_path / "with-kv-scales")
    shutil.copytree(tiny_llama_dir, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.02)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.003)
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([0.04])
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([0.005])
    save_file(tensors, path)
    caplog.set_level("INFO", logger="pagedllm")
    llm = LLM(model=dst, kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 20, max_model_len=256)
    layers = _attn_layers(llm)
    got = torch.stack([layer.kv_scales for layer in layers])
    torch.testing.assert_close(got, torch.tensor([[0.02, 0.003], [0.04, 0.005]]))
    assert all(layer.kv_scale_source == "checkpoint" for layer in layers)
    assert any("scales from the checkpoint" in r.getMessage() for r in caplog.records)
    assert not any("Ignoring" in r.getMessage() and "scale" in r.getMessage() for r in caplog.records)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    torch.testing.assert_close(torch.stack([layer.kv_scales for layer in layers]), got)  # no calibration
    # The same checkpoint with the model-dtype cache: the scales load (and are unused), nothing is refused.
    LLM(model=dst, kv_cache_memory_bytes=1 << 20, max_model_len=256).generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    # With PAGEDLLM_KV_SCALES=0 the FP8 cache stays unscaled and says why.
    monkeypatch.setenv("PAGEDLLM_KV_SCALES", "0")
    caplog.clear()
    plain = LLM(model=dst, kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 20, max_model_len=256)
    assert all(layer.kv_scale_source is None and torch.equal(layer.kv_scales, torch.ones(2))
               for layer in _attn_layers(plain))
    assert any("scales are not used" in r.getMessage() for r in caplog.records)
