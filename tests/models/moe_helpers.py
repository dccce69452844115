"""Tiny random mixture-of-experts checkpoints saved as real Hugging Face directories (transformers'
save_pretrained: the hub's per-expert tensor names), and the `tiny_moe_dir` fixture that builds each once per
session. Import the fixture into a test module: `from tests.models.moe_helpers import tiny_moe_dir  # noqa: F401`.

    mixtral    8 experts, top-2 (always renormalized), 2 layers
    qwen3_moe  8 experts, top-2, norm_topk_prob, head_dim 32 (q/k norm); 3 layers, the middle one dense
               (mlp_only_layers=[1]) as transformers builds it
    qwen2_moe  6 experts, top-2, not renormalized, a sigmoid-gated shared expert, decoder_sparse_step 2
               (layers 1 and 3 sparse, 0 and 2 dense); 4 layers
All: vocab 512, hidden 64, 4 heads / 2 KV heads, the tests' byte-level tokenizer (tests/conftest.py)."""
from __future__ import annotations

from typing import Any, Callable

import pytest

MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe")
_built: dict[tuple, str] = {}


def tiny_moe_config(arch: str, **overrides: Any) -> Any:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.05, bos_token_id=0, eos_token_id=1,
                  pad_token_id=None, tie_word_embeddings=False)
    if arch == "mixtral":
        cfg = MixtralConfig(**common, num_hidden_layers=2, intermediate_size=96, num_local_experts=8,
                            num_experts_per_tok=2, sliding_window=None, architectures=["MixtralForCausalLM"])
    elif arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=48,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                             head_dim=32, architectures=["Qwen3MoeForCausalLM"])
    elif arch == "qwen2_moe":
        cfg = Qwen2MoeConfig(**common, num_hidden_layers=4, intermediate_size=128, moe_intermediate_size=48,
                             shared_expert_intermediate_size=80, num_experts=6, num_experts_per_tok=2,
                             norm_topk_prob=False, decoder_sparse_step=2, architectures=["Qwen2MoeForCausalLM"])
    else:
        raise ValueError(f"unknown tiny MoE arch {arch!r}; choose from {MOE_ARCHS}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Factory: tiny_moe_dir(arch, **config overrides) -> a saved HF directory (built once per argument set)."""
    from tests.conftest import save_tiny_model

    def make(arch: str, **overrides: Any) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in _built:
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}-{len(_built)}"))
            _built[key] = save_tiny_model(path, tiny_moe_config(arch, **overrides))
        return _built[key]

    return make
