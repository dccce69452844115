"""Sliding-window attention: which layers get a window, and the models against transformers past the window."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.attention import Attention
from pagedllm.models.llama import layer_sliding_window
from pagedllm.models.loader import get_model, load_hf_config
from tests.models.swa_helpers import save_swa_model


def _layer_windows(config):
    return [layer_sliding_window(config, i) for i in range(config.num_hidden_layers)]


def test_layer_windows_follow_transformers_configs():
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    assert _layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=16)) == [16, 16, 16]
    assert _layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    from transformers import LlamaConfig
    assert _layer_windows(LlamaConfig(num_hidden_layers=2, sliding_window=16)) == [None, None]  # HF Llama has none
    # Qwen2/Qwen3: sliding layers are those from max_window_layers on, only with use_sliding_window
    assert _layer_windows(Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8,
                                      max_window_layers=2)) == [None, None, 8, 8]
    assert _layer_windows(Qwen2Config(num_hidden_layers=2, use_sliding_window=False, sliding_window=8,
                                      max_window_layers=0)) == [None, None]
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    assert _layer_windows(Qwen3Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=32,
                                      layer_types=types)) == [32, None, 32]


def test_attention_stores_the_window_and_refuses_bad_ones():
    assert Attention(4, 16, 0.25, 2, prefix="x", sliding_window=8).sliding_window == 8
    assert Attention(4, 16, 0.25, 2, prefix="x").sliding_window is None
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        Attention(4, 16, 0.25, 2, prefix="x", sliding_window=0)


def test_models_pass_each_layer_its_window(tmp_path):
    model_dir = save_swa_model(str(tmp_path), "qwen2", use_sliding_window=True, sliding_window=16,
                               max_window_layers=1)
    model = get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu")
    assert [a.sliding_window for a in model.attn_layers] == [None, 16]


def _no_cache_logits(model, ids):
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0])))


@pytest.mark.parametrize("arch,overrides", [
    ("mistral", dict(sliding_window=24)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=20, max_window_layers=1, num_hidden_layers=3)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=20, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
])
def test_logits_match_transformers_past_the_window(tmp_path, arch, overrides):
    """A prompt 12x the window, no KV cache (the model's own path, queries in chunks over their windows): logits
    equal transformers' in fp32; with the window removed they do not."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = save_swa_model(str(tmp_path), arch, **overrides)
    ours = get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(3))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(ids[None], use_cache=False).logits[0]
    out = _no_cache_logits(ours, ids)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    config = AutoConfig.from_pretrained(model_dir)
    if arch == "mistral":
        config.sliding_window = None
    else:
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    full = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    with torch.inference_mode():
        assert (full(ids[None], use_cache=False).logits[0] - out).abs().max() > 1e-2


@pytest.mark.parametrize("arch,layer_types,use_sliding_window,windows", [
    ("mistral", False, False, [16, 16]),
    ("mistral", True, False, [None, 16]),  # transformers loads it as Ministral, which reads layer_types
    ("mixtral", True, False, [16, 16]),
    ("phi3", True, False, [16, 16]),
    ("qwen3_moe", True, True, [16, 16, 16]),
])
def test_window_options_transformers_ignores(tmp_path, arch, layer_types, use_sliding_window, windows):
    """Mistral, Mixtral and Phi-3 apply `sliding_window` whatever `use_sliding_window` says; Mixtral, Phi-3 and
    Qwen3-MoE to every layer whatever a `layer_types` in config.json says (they do not read them): so does
    pagedllm, and the logits past the window equal transformers'."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import save_tiny_model, tiny_hf_config
    from tests.models.moe_helpers import tiny_moe_config

    if arch in ("mistral", "phi3"):
        config = tiny_hf_config("phi3_plain" if arch == "phi3" else arch)
    else:
        config = tiny_moe_config(arch)
    config.sliding_window, config.use_sliding_window = 16, use_sliding_window
    if layer_types:
        config.layer_types = ["full_attention", "sliding_attention"] + ["full_attention"] * (len(windows) - 2)
    model_dir = save_tiny_model(str(tmp_path), config)
    ours = get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu")
    assert [a.sliding_window for a in ours.attn_layers] == windows
    assert ours.kv_layer_windows() == windows
    ids = torch.randint(0, 512, (80,), generator=torch.Generator().manual_seed(4))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(ids[None], use_cache=False).logits[0]
    torch.testing.assert_close(_no_cache_logits(ours, ids), ref, atol=1e-4, rtol=1e-4)
