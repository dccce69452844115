"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3 attention (per-head q/k RMSNorm), sparse MLP layers of
`num_experts` experts of `moe_intermediate_size`, top `num_experts_per_tok`, renormalized when `norm_topk_prob`.

A layer is sparse unless listed in `mlp_only_layers`, and only every `decoder_sparse_step`-th layer is
((index + 1) % step == 0); the others are dense SwiGLU MLPs of `intermediate_size`. Checkpoint experts:
`mlp.experts.N.gate_proj/up_proj/down_proj` (the hub) or stacked `mlp.experts.gate_up_proj` / `down_proj`
(transformers 5).
"""
from __future__ import annotations

from typing import Any, Optional

from pagedllm.models.moe import MoEDecoderLayer, MoEForCausalLM, MoESpec
from pagedllm.models.qwen3 import Qwen3Attention


def num_experts(config: Any) -> int:
    """transformers 5 stores Qwen3-MoE's expert count as num_local_experts (num_experts is its alias)."""
    count = getattr(config, "num_experts", None)
    return count if count is not None else config.num_local_experts


def is_sparse_layer(config: Any, index: int) -> bool:
    """transformers' rule for Qwen2-MoE and Qwen3-MoE."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (index not in (getattr(config, "mlp_only_layers", None) or []) and num_experts(config) > 0
            and (index + 1) % step == 0)


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen3Attention

    @classmethod
    def moe_spec(cls, config: Any, index: int) -> Optional[MoESpec]:
        if not is_sparse_layer(config, index):
            return None
        return MoESpec(num_experts=num_experts(config), top_k=config.num_experts_per_tok,
                       intermediate_size=config.moe_intermediate_size,
                       renormalize=bool(getattr(config, "norm_topk_prob", False)))


class Qwen3MoeForCausalLM(MoEForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
