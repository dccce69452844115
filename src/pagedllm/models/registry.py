"""Model registry: HF `config.architectures[0]` -> our model class, imported lazily on first use.

Importing this module imports neither torch nor any model file.
"""
from __future__ import annotations

import importlib
from typing import Any, Union

from pagedllm.pooling import EMBEDDING_ONLY_ARCHITECTURES

# architecture name -> (module under pagedllm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForConditionalGeneration"),  # its text model only
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    # sequence classifiers (pooling.CLASSIFIER_ARCHITECTURES): classification and scoring only
    "LlamaForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("qwen2", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("qwen3", "Qwen3ForSequenceClassification"),
    # token classifiers (pooling.TOKEN_CLASSIFIER_ARCHITECTURES): per-token label logits only
    "LlamaForTokenClassification": ("llama", "LlamaForTokenClassification"),
    "MistralForTokenClassification": ("llama", "LlamaForTokenClassification"),
    "Qwen2ForTokenClassification": ("qwen2", "Qwen2ForTokenClassification"),
    "Qwen3ForTokenClassification": ("qwen3", "Qwen3ForTokenClassification"),
    # reward models (pooling.REWARD_MODEL_ARCHITECTURES): per-token rewards through a two-layer head
    "Qwen2ForRewardModel": ("qwen2", "Qwen2ForRewardModel"),
    "Qwen2ForProcessRewardModel": ("qwen2", "Qwen2ForProcessRewardModel"),
}

# Multimodal checkpoints served as their text model: the loader hands the model class the config's text_config
# (models/loader.served_text_config); the class maps the checkpoint's language-model tensor names.
TEXT_MODEL_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)

# config.model_type -> architecture, for configs saved without `architectures`.
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                       "qwen3_moe": "Qwen3MoeForCausalLM",
                       "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                       "gemma3": "Gemma3ForConditionalGeneration", "phi3": "Phi3ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(set(_MODELS) | set(EMBEDDING_ONLY_ARCHITECTURES))


def register_model(architecture: str, module: str, class_name: str) -> None:
    """Add (or override) an architecture; `module` is a full dotted module path or a pagedllm.models name."""
    _MODELS[architecture] = (module, class_name)


def get_architecture(hf_config: Any) -> str:
    """`config.architectures[0]`, else inferred from `config.model_type`."""
    architectures = getattr(hf_config, "architectures", None) or []
    if isinstance(architectures, str):  # a config that writes one name, not a list: the name, not its first letter
        architectures = [architectures]
    if architectures:
        return architectures[0]
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise ValueError(f"The model config names no architecture (model_type={model_type!r}); supported: "
                     f"{', '.join(supported_architectures())}.")


def is_supported(hf_config_or_arch: Union[str, Any]) -> bool:
    try:
        arch = hf_config_or_arch if isinstance(hf_config_or_arch, str) else get_architecture(hf_config_or_arch)
    except ValueError:
        return False
    return EMBEDDING_ONLY_ARCHITECTURES.get(arch, arch) in _MODELS


def get_model_class(hf_config_or_arch: Union[str, Any]) -> type:
    """The model class for a HF config (or an architecture name); ValueError if unsupported."""
    arch = hf_config_or_arch if isinstance(hf_config_or_arch, str) else get_architecture(hf_config_or_arch)
    arch = EMBEDDING_ONLY_ARCHITECTURES.get(arch, arch)  # a decoder stack without its head: the causal class
    if arch not in _MODELS:
        raise ValueError(f"Model architecture {arch} is not supported; supported: "
                         f"{', '.join(supported_architectures())}.")
    module_name, class_name = _MODELS[arch]
    if "." not in module_name:
        module_name = f"pagedllm.models.{module_name}"
    return getattr(importlib.import_module(module_name), class_name)
