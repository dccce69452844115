"""Gemma 3 (text): Gemma 2's layout (models/gemma2.py) with

  * a (1 + w) RMSNorm over each q and k head before rope (like Qwen3's q/k norm, in Gemma's form);
  * two rope bases: global layers use rope_parameters["full_attention"] (rope_theta, and the linear scaling of
    the 4B+ models), local sliding-window layers rope_parameters["sliding_attention"] (`rope_local_base_freq`,
    10 000, unscaled), each layer with its own cos/sin cache;
  * local and global layers from `layer_types` (5 local : 1 global; older configs: `sliding_window_pattern`,
    which transformers' config turns into layer_types);
  * no attention logit soft-capping (transformers' Gemma 3 ignores `attn_logit_softcapping`); the final logit
    soft-capping only when the config sets it (Gemma 3 checkpoints do not).

`Gemma3ForConditionalGeneration` checkpoints (the multimodal release, 4B and up) are served as their text model:
the loader gives that class the `text_config` (models/loader.served_text_config); it loads the language model's
tensors under their causal-LM names and skips the vision tower's. Image inputs are not supported.
"""
from __future__ import annotations

import types
from typing import Any, Iterable, Optional

import torch

from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.rotary_embedding import get_rope, get_rope_parameters
from pagedllm.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model
from pagedllm.models.llama import PerHeadQKNorm, get_head_dim


def local_rope_parameters(config: Any) -> dict[str, Any]:
    """The rope of the sliding-window layers: transformers >= 5 keeps it in rope_parameters["sliding_attention"],
    older versions as rope_local_base_freq (without scaling)."""
    per_type = getattr(config, "rope_parameters", None)
    if isinstance(per_type, dict) and isinstance(per_type.get("sliding_attention"), dict):
        return get_rope_parameters(types.SimpleNamespace(rope_parameters=per_type["sliding_attention"]))
    base = getattr(config, "rope_local_base_freq", None) or 10000.0
    return {"rope_type": "default", "rope_theta": float(base), "partial_rotary_factor": 1.0}


class Gemma3Attention(PerHeadQKNorm, Gemma2Attention):
    # (1 + w) q/k norms: their float32 weights reach the fused kernels (`qk_norm`), which take a float32 weight's
    # product in float32 (Triton's qkv_prep) or run in float32 models only (the CPU decode stack).
    qk_norm_cls = GemmaRMSNorm

    @staticmethod
    def attn_logit_softcap(config: Any) -> Optional[float]:
        return None


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(Gemma2Model):
    def __init__(self, config: Any, layer_cls: type = Gemma3DecoderLayer, prefix: str = "model",
                 quant_config: Any = None) -> None:
        super().__init__(config, layer_cls, prefix, quant_config)
        # self.rotary_emb (LlamaModel's, from the "full_attention" parameters) serves the global layers.
        self.local_rotary_emb = get_rope(get_head_dim(config), config.max_position_embeddings,
                                         local_rope_parameters(config))
        for i in range(self.start_layer, self.end_layer):
            if config.layer_types[i] == "sliding_attention":
                self.layers[i].self_attn.rotary_emb = self.local_rotary_emb


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer
    model_cls = Gemma3Model


class LanguageModelNames:
    """A quantization config that the layers of a multimodal checkpoint's language model ask by their causal-LM
    names (`model.layers.0.mlp.down_proj`) while its ignore list / targets name them as the checkpoint does
    (`language_model.model.layers.0...`, `model.language_model.layers.0...`): a layer any of the three names
    skips stays float; else the first name a scheme covers picks the method, the checkpoint's names first (a
    target naming them is more specific than one that matches every name, such as the class "Linear")."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # (before __init__ ran: a copy or unpickling; no recursion)
            raise AttributeError(name)
        return getattr(self._inner, name)

    def get_linear_method(self, layer: Any, prefix: str) -> Any:
        from pagedllm.quantization.base import is_layer_skipped

        rest = prefix[len("model."):] if prefix.startswith("model.") else None
        names = [f"language_model.{prefix}"] + ([f"model.language_model.{rest}"] if rest else []) + [prefix]
        ignored = getattr(self._inner, "ignore", None) or getattr(self._inner, "modules_to_not_convert", None)
        parents = getattr(self._inner, "ignore_parents", True)
        if ignored and any(is_layer_skipped(name, ignored, parents) for name in names):
            return None
        leaves_float = getattr(self._inner, "leaves_float", None)  # (GPTQ's dynamic "-:" keys)
        if leaves_float is not None and any(leaves_float(name) for name in names):
            return None
        return next((m for m in (self._inner.get_linear_method(layer, n) for n in names) if m is not None), None)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a multimodal Gemma 3 checkpoint (images are not supported): built from its text_config,
    loading the language model's tensors under their causal-LM names and skipping the vision tower's."""

    _PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."))
    _SKIPPED = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")

    def __init__(self, hf_config: Any, dtype: Optional[torch.dtype] = None, quant_config: Any = None) -> None:
        text_config = getattr(hf_config, "text_config", None) or hf_config
        if quant_config is None or getattr(quant_config, "online", False):
            super().__init__(text_config, dtype, quant_config)
            return
        # a checkpoint's quantization names the language model's layers by their checkpoint names
        super().__init__(text_config, dtype, LanguageModelNames(quant_config))
        self.quant_config = quant_config

    def lora_module_name(self, name: str) -> Optional[str]:
        """A PEFT adapter's module name (`model.language_model.layers.0.self_attn.q_proj`) as this model's; None
        for the vision tower's and projector's (PEFT adapts them too when targets name q_proj...: they never run on
        the text-only prompts served here, so they change no output)."""
        if name.startswith(self._SKIPPED):
            return None
        for old, new in self._PREFIXES:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(self._SKIPPED):
                    continue
                for old, new in self._PREFIXES:
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                yield name, tensor

        return super().load_weights(renamed())
