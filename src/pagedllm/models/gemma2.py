"""Gemma 2: the Llama layout with Gemma's changes, as transformers' Gemma2ForCausalLM computes them.

  * embeddings multiplied by sqrt(hidden_size), that factor rounded to the model dtype first (HF's
    Gemma2TextScaledWordEmbedding: 55.5 rather than 55.43 in bf16 for hidden 3072);
  * every RMSNorm scales by (1 + w) in float32 (layers/layernorm.GemmaRMSNorm);
  * four norms per layer: input, post-attention (on the attention output, before the residual add),
    pre-feed-forward and post-feed-forward (likewise around the MLP);
  * a GeGLU MLP (gelu with the tanh approximation, `hidden_activation`);
  * attention scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, its logits soft-capped
    (cap * tanh(logits / cap), `attn_logit_softcapping`), sliding-window layers alternating with global ones
    (`layer_types`: even layers local);
  * the final logits soft-capped too (`final_logit_softcapping`); embeddings tied to the LM head.

Gemma 3 (models/gemma3.py) reuses these classes. Shapes: T = tokens of the flattened batch.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.layers.activation import get_gated_act_fn
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, layer_index,
                                   layer_sliding_window)


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, prefix: str = "", quant_config: Any = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias=False, prefix=f"{prefix}.gate_up_proj",
                                                       quant_config=quant_config)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False,
                                           prefix=f"{prefix}.down_proj", quant_config=quant_config)
        # Gemma configs name it hidden_activation (gelu_pytorch_tanh); older ones also carry hidden_act.
        self.act_fn = get_gated_act_fn(getattr(config, "hidden_activation", None) or config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2 * inter / tp] -> [T, hidden]


class Gemma2Attention(LlamaAttention):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str = "", quant_config: Any = None
                 ) -> None:
        super().__init__(config, rotary_emb, prefix, quant_config)
        self.attn = Attention(self.num_heads, self.head_dim, float(config.query_pre_attn_scalar) ** -0.5,
                              self.num_kv_heads, prefix=f"{prefix}.attn",
                              sliding_window=layer_sliding_window(config, layer_index(prefix)),
                              logits_soft_cap=self.attn_logit_softcap(config))

    @staticmethod
    def attn_logit_softcap(config: Any) -> Optional[float]:
        cap = getattr(config, "attn_logit_softcapping", None)
        return float(cap) if cap else None


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with Gemma's MLP and norms, two more norms and its own forward."""

    attention_cls = Gemma2Attention
    mlp_cls = GemmaMLP
    norm_cls = GemmaRMSNorm

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str = "", quant_config: Any = None
                 ) -> None:
        super().__init__(config, rotary_emb, prefix, quant_config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = self.norm_cls(hidden, eps)
        self.post_feedforward_layernorm = self.norm_cls(hidden, eps)

    def norm_feeds(self) -> list[tuple[str, str]]:
        return [("input_layernorm", "self_attn.qkv_proj"), ("pre_feedforward_layernorm", "mlp.gate_up_proj")]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # As in Llama the residual stream is carried separately and added inside the next norm:
        # HF's `residual + post_norm(sublayer(pre_norm(h)))`, twice, in the same order of additions.
        hidden_states, residual = self.input_norm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma2Model(LlamaModel):
    """LlamaModel with Gemma's final norm and scaled embeddings (`embed`: the CPU decode stack embeds through it
    too)."""

    def __init__(self, config: Any, layer_cls: type = Gemma2DecoderLayer, prefix: str = "model",
                 quant_config: Any = None) -> None:
        super().__init__(config, layer_cls, prefix, quant_config)
        if self.is_last_stage:
            self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # sqrt(hidden) as HF multiplies by it: a tensor in the model dtype (built under the model's default dtype)
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5, dtype=torch.get_default_dtype()))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale  # [T, hidden]


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma2DecoderLayer
    model_cls = Gemma2Model

    def __init__(self, hf_config: Any, dtype: Optional[torch.dtype] = None, quant_config: Any = None) -> None:
        super().__init__(hf_config, dtype, quant_config)
        cap = getattr(hf_config, "final_logit_softcapping", None)
        self.final_logit_softcap: Optional[float] = float(cap) if cap else None

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError(f"{cls.__name__}: use_bidirectional_attention=True (an embedding model such as "
                             f"EmbeddingGemma) is not supported; pagedllm serves causal language models.")
        super().check_config(hf_config)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)  # [N, vocab] float32
        cap = self.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def sample_logits(self, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        return None if self.final_logit_softcap is not None else self.head_logits(hidden_states)

    def greedy_token_ids(self, hidden_states: torch.Tensor,
                         token_bitmask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        # tanh keeps the order, but in float32 two logits near the cap can round to the same capped value: the
        # argmax of the capped logits (transformers') is then the first of them, which the raw argmax may not be.
        if self.final_logit_softcap is not None:
            return None
        return super().greedy_token_ids(hidden_states, token_bitmask)
