"""Qwen3 (dense): the Llama layout plus an RMSNorm over each q and k head before rope.

head_dim comes from the config (it need not be hidden_size / num_heads); q/k/v/o biases follow
`attention_bias` (False for released models).
"""
from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str = "", quant_config: Any = None
                 ) -> None:
        super().__init__(config, rotary_emb, prefix, quant_config)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        # [T, heads * head_dim] -> per-head norm over head_dim -> [T, heads * head_dim]
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim)).view(num_tokens, -1)
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)).view(num_tokens, -1)
        return q, k

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        assert self.q_norm.variance_epsilon == self.k_norm.variance_epsilon
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
