"""Qwen2 / Qwen2.5: the Llama layout with a bias on q/k/v (none on o_proj)."""
from __future__ import annotations

from typing import Any

from pagedllm.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, RewardHead,
                                   SequenceClassifier, TokenClassifier)


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def projection_biases(config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer


class Qwen2ForSequenceClassification(SequenceClassifier, Qwen2ForCausalLM):
    """Qwen2 with a classification head (llama.SequenceClassifier)."""


class Qwen2ForTokenClassification(TokenClassifier, Qwen2ForCausalLM):
    """Qwen2 with a per-token classification head (llama.TokenClassifier)."""


class Qwen2ForRewardModel(RewardHead, Qwen2ForCausalLM):
    """Qwen2.5-Math-RM: one reward per token (llama.RewardHead, one label); vLLM pools ALL."""

    reward_architecture = "Qwen2ForRewardModel"


class Qwen2ForProcessRewardModel(RewardHead, Qwen2ForCausalLM):
    """Qwen2.5-Math-PRM: two label logits per token (llama.RewardHead); vLLM pools STEP by default."""

    reward_architecture = "Qwen2ForProcessRewardModel"
