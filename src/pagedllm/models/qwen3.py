"""Qwen3 (dense): the Llama layout plus an RMSNorm over each q and k head before rope.

head_dim comes from the config (it need not be hidden_size / num_heads); q/k/v/o biases follow
`attention_bias` (False for released models).
"""
from __future__ import annotations

from pagedllm.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, PerHeadQKNorm,
                                   SequenceClassifier, TokenClassifier)


class Qwen3Attention(PerHeadQKNorm, LlamaAttention):
    """Llama attention with an RMSNorm over each q and k head before rope."""


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForSequenceClassification(SequenceClassifier, Qwen3ForCausalLM):
    """Qwen3 with a classification head (llama.SequenceClassifier): e.g. cross-encoder rerankers."""


class Qwen3ForTokenClassification(TokenClassifier, Qwen3ForCausalLM):
    """Qwen3 with a per-token classification head (llama.TokenClassifier)."""
