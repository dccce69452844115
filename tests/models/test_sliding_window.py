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
