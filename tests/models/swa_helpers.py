"""Tiny sliding-window checkpoints (real HF directories) for the model and engine tests."""
from __future__ import annotations

from typing import Any

from tests.conftest import TINY_VOCAB_SIZE, save_tiny_model

COMMON = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.05,
              bos_token_id=0, eos_token_id=1, pad_token_id=None)


def swa_config(arch: str, **overrides: Any) -> Any:
    """mistral: the window on every layer; qwen2 / qwen3: use_sliding_window with max_window_layers or
    layer_types (built by the config class itself, so config.json holds what transformers computes)."""
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    kwargs = {**COMMON, **overrides}
    if arch == "mistral":
        return MistralConfig(**kwargs, architectures=["MistralForCausalLM"])
    if arch == "qwen2":
        return Qwen2Config(**kwargs, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3":
        return Qwen3Config(**{"head_dim": 32, **kwargs}, architectures=["Qwen3ForCausalLM"])
    raise ValueError(arch)


def save_swa_model(path: str, arch: str, seed: int = 0, **overrides: Any) -> str:
    return save_tiny_model(path, swa_config(arch, **overrides), seed=seed)
