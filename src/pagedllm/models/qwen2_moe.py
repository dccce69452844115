"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention (bias on q/k/v), sparse layers as Qwen3-MoE's
plus a shared expert every token takes (`shared_expert`, a SwiGLU MLP of `shared_expert_intermediate_size`)
scaled by sigmoid(`shared_expert_gate` . x)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from pagedllm.models.moe import MoEDecoderLayer, MoEForCausalLM, MoESpec
from pagedllm.models.qwen2 import Qwen2Attention
from pagedllm.models.qwen3_moe import Qwen3MoeDecoderLayer


class Qwen2MoeAttention(Qwen2Attention):
    @staticmethod
    def projection_biases(config: Any) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False  # transformers < 5 has no qkv_bias: always on


class Qwen2MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen2MoeAttention

    @classmethod
    def moe_spec(cls, config: Any, index: int) -> Optional[MoESpec]:
        spec = Qwen3MoeDecoderLayer.moe_spec(config, index)  # same routing; only the shared expert is added
        if spec is None:
            return None
        return dataclasses.replace(
            spec, shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0)


class Qwen2MoeForCausalLM(MoEForCausalLM):
    layer_cls = Qwen2MoeDecoderLayer
