"""Tiny random checkpoints of the Gemma 2, Gemma 3 and Phi-3 families (transformers' own config classes), for
tests/conftest.py's `tiny_model_dir(arch)` factory. Not a test module.

    gemma2   4 layers (local, global, local, global), head_dim 32 != hidden / heads, query_pre_attn_scalar 24,
             attention and final logit soft-capping at caps the random activations reach, window 512 (no
             effect below it; `sliding_window=` overrides), tied embeddings
    gemma3   6 layers in 5 : 1 local : global (sliding_window_pattern 6), q/k norms, rope 1e6 with linear scaling
             x2 on the global layer and 1e4 on the local ones, window 512 unless overridden
    phi3     longrope (original context 32, 256 positions, made-up short / long factors), partial rotary 0.75
             (12 of 16 dims), untied
    phi3_plain  no rope scaling, full rotary (Phi-3-mini-4k's shape)

Gemma's RMSNorm weights start at zero in transformers' init, which would leave its (1 + w) untested: every norm
weight is redrawn from N(0, 0.3) before saving.
"""
from __future__ import annotations

from typing import Any, Optional

FAMILY_ARCHS = ("gemma2", "gemma3", "phi3", "phi3_plain")


def family_config(arch: str, common: dict, tie_word_embeddings: Optional[bool]) -> Any:
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config

    if arch == "gemma2":
        return Gemma2Config(**{**common, "num_hidden_layers": 4}, head_dim=32, query_pre_attn_scalar=24,
                            attn_logit_softcapping=1.0, final_logit_softcapping=2.0, sliding_window=512,
                            architectures=["Gemma2ForCausalLM"],
                            tie_word_embeddings=True if tie_word_embeddings is None else tie_word_embeddings)
    if arch == "gemma3":
        return Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, head_dim=32, query_pre_attn_scalar=24,
                                sliding_window=512, sliding_window_pattern=6,
                                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                    "rope_theta": 1_000_000.0},
                                                 "sliding_attention": {"rope_type": "default",
                                                                       "rope_theta": 10_000.0}},
                                architectures=["Gemma3ForCausalLM"],
                                tie_word_embeddings=True if tie_word_embeddings is None else tie_word_embeddings)
    if arch == "phi3":
        rotary_half = 6  # 0.75 * head_dim 16 / 2
        rope = {"rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
                "long_factor": [1.5 + 2.0 * i for i in range(rotary_half)]}
        return Phi3Config(**{**common, "max_position_embeddings": 256}, original_max_position_embeddings=32,
                          rope_parameters=rope, architectures=["Phi3ForCausalLM"],
                          tie_word_embeddings=bool(tie_word_embeddings))
    if arch == "phi3_plain":
        return Phi3Config(**common, original_max_position_embeddings=512, architectures=["Phi3ForCausalLM"],
                          tie_word_embeddings=bool(tie_word_embeddings))
    raise ValueError(f"unknown family arch {arch!r}; choose from {FAMILY_ARCHS}")


def randomize_norms(model: Any, seed: int = 0) -> None:
    """Redraw every RMSNorm weight (Gemma's are zero-initialized: (1 + w) would be 1 everywhere)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + (0.0 if "gemma" in
                                                                            model.config.model_type else 1.0))


def save_tiny_gemma3_multimodal(path: str, tie_word_embeddings: Optional[bool] = None) -> Any:
    """A Gemma3ForConditionalGeneration (a tiny SigLIP tower; language model = the tiny gemma3) saved with the
    tests' tokenizer; returns the transformers model."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from tests.conftest import build_tiny_tokenizer, tiny_hf_config
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=tiny_hf_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, boi_token_index=508, eoi_token_index=509, image_token_index=510,
                          architectures=["Gemma3ForConditionalGeneration"],
                          **({} if tie_word_embeddings is None else {"tie_word_embeddings": tie_word_embeddings}))
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    randomize_norms(model.model.language_model)
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return model
