"""Read a PEFT LoRA adapter directory into host tensors, refusing what the engine does not run.

A directory holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and
`adapter_model.safetensors` (or `adapter_model.bin`) with keys
`base_model.model.<module path>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. The delta of a
module is `x @ A^T @ B^T * scaling`, scaling = alpha / r (alpha / sqrt(r) with rsLoRA); the scaling is
folded into B here, once.

Every refusal is a `LoRAError` (a ValueError) whose message is one sentence saying why.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger("pagedllm")


class LoRAError(ValueError):
    """An adapter that cannot be served (bad path, unsupported feature, shape mismatch): a user error."""


@dataclass
class LoRAAdapter:
    """One adapter in host memory: per PEFT module name, A [r, in] and B*scaling [out, r] (the model's dtype)."""

    lora_int_id: int
    name: str
    path: str
    rank: int  # the largest rank over its modules
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


_LAYER = re.compile(r"\.layers\.(\d+)\.")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>A|B)(?:\.[A-Za-z0-9_\-]+)?\.weight$")
_EMBED_HINTS = ("embed_tokens", "lm_head", "wte", "embed_out", "word_embeddings")
PEFT_DEFAULT_LORA_ALPHA = 8  # peft.LoraConfig().lora_alpha


def read_adapter_config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter path {path!r} is not a directory (it must hold adapter_config.json and "
                        "adapter_model.safetensors).")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise LoRAError(f"LoRA adapter path {path!r} has no adapter_config.json.")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError(f"Cannot read {config_path}: {e}.")
    if not isinstance(config, dict):
        raise LoRAError(f"{config_path} is not a JSON object.")
    check_adapter_config(config, path)
    return config


def check_adapter_config(config: dict[str, Any], path: str) -> None:
    """Refuse PEFT features whose math the engine does not implement (each would silently change outputs)."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"Adapter {path!r} is a {peft_type} adapter; only LoRA adapters are supported.")
    refusals = [
        (config.get("use_dora"), "DoRA adapters (use_dora=true) are not supported"),
        (config.get("modules_to_save"), "adapters with modules_to_save (fully trained extra modules) are not "
                                        "supported"),
        (config.get("bias", "none") not in ("none", None), f"adapters with bias={config.get('bias')!r} are not "
                                                           "supported (only bias='none')"),
        (config.get("lora_bias"), "adapters with lora_bias=true are not supported"),
        (config.get("fan_in_fan_out"), "adapters with fan_in_fan_out=true (Conv1D bases) are not supported"),
        (config.get("layer_replication"), "adapters with layer_replication are not supported"),
        (config.get("target_parameters"), "adapters with target_parameters are not supported"),
        (config.get("use_qalora"), "QA-LoRA adapters (use_qalora=true) are not supported"),
        # PEFT variants whose inference math is not plain LoRA's (VeLoRA and MiCA change training only)
        (config.get("alora_invocation_tokens"), "Activated LoRA adapters (alora_invocation_tokens) are not "
                                                "supported"),
        (config.get("kasa_config"), "KaSA adapters (kasa_config) are not supported"),
        (config.get("use_bdlora"), "block-diagonal LoRA adapters (use_bdlora) are not supported"),
        (config.get("arrow_config"), "Arrow-routed adapters (arrow_config) are not supported"),
        (config.get("monteclora_config"), "MonteCLoRA adapters (monteclora_config) are not supported"),
        (config.get("trainable_token_indices"), "adapters with trainable_token_indices (trained embedding rows) "
                                                "are not supported"),
    ]
    for bad, why in refusals:
        if bad:
            raise LoRAError(f"Cannot load LoRA adapter {path!r}: {why}.")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    for target in targets:
        if any(h in str(target) for h in _EMBED_HINTS):
            raise LoRAError(f"Cannot load LoRA adapter {path!r}: it targets {target!r}; LoRA on the embedding or "
                            "the LM head is not supported (only q/k/v/o and gate/up/down projections).")


def _load_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        try:
            return load_file(st, device="cpu")
        except Exception as e:  # noqa: BLE001 - a corrupt file is the user's input
            raise LoRAError(f"Cannot read {st}: {e}.")
    binary = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(binary):
        try:
            return torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise LoRAError(f"Cannot read {binary}: {e}.")
    raise LoRAError(f"LoRA adapter path {path!r} has no adapter_model.safetensors or adapter_model.bin.")


def _pattern_value(patterns: Optional[dict], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name ending in it."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_adapter(lora_int_id: int, name: str, path: str, expected: dict[str, tuple[int, int]],
                 max_lora_rank: int, dtype: torch.dtype = torch.float32,
                 local_layers: Optional[range] = None, fused: Optional[dict[str, list[str]]] = None,
                 rename: Optional[Callable[[str], Optional[str]]] = None,
                 num_layers: Optional[int] = None) -> LoRAAdapter:
    """Read and validate an adapter against the model: `expected` maps each adaptable module's PEFT name
    (e.g. "model.layers.0.self_attn.q_proj") to its full (in_features, out_features). The host copy is kept in
    `dtype` (the model's: a bf16 model's adapters take half the host memory of fp32 ones); the scaling is applied
    in fp32 first. With `local_layers` (a pipeline stage's decoder layers) modules of other layers are skipped:
    the stage that holds them checks and keeps them. `fused` maps a merged layer's own name (Phi-3's
    "model.layers.0.self_attn.qkv_proj", whose checkpoint and PEFT adapters keep it whole) to its slices' names in
    `expected`, in row order: such a module's B is split by rows, the slices sharing its A (the same delta).
    `rename` (the model's `lora_module_name`) maps a checkpoint's module name to the model's, None for a module the
    served model does not run (a multimodal checkpoint's vision tower, when it serves its text model alone).
    `num_layers` (the model's decoder layers, all stages) refuses modules of layers the model does not have."""
    path = os.path.expanduser(path)  # vLLM's get_adapter_absolute_path: "~/loras/sql" is the user's
    config = read_adapter_config(path)
    tensors = _load_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    renamed: dict[str, str] = {}  # the model's module name -> the checkpoint's (PEFT's patterns match the latter)
    skipped: set[str] = set()
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            if "lora_embedding" in key:
                why = "LoRA on the embedding is not supported"
            elif "lora_magnitude_vector" in key:
                why = "DoRA adapters are not supported"
            elif "modules_to_save" in key:
                why = "adapters with modules_to_save are not supported"
            elif any(h in key for h in _EMBED_HINTS):
                # PEFT's save_embedding_layers (on by default once the vocabulary was resized for new tokens)
                why = (f"it holds the full weight {key!r} (PEFT's saved embedding layers, as after adding new tokens); "
                       "adapters with their own embedding or LM head weights are not supported")
            else:
                why = f"it holds tensor {key!r}, which is not a LoRA A/B weight"
            raise LoRAError(f"Cannot load LoRA adapter {path!r}: {why}.")
        module = match["module"] if rename is None else rename(match["module"])
        if module is not None and module.startswith("layers.") and module not in expected:
            # an adapter of a decoder stack saved alone (AutoModel: e5-mistral, gte-Qwen2) names its layers as that
            # checkpoint does, `layers.0...`; the loader gives those the causal model's `model.` prefix, so here too
            module = "model." + module
        if module is None:
            skipped.add(match["module"])
            continue
        renamed[module] = match["module"]
        pairs.setdefault(module, {})[match["ab"]] = tensor
    if skipped and not pairs:
        raise LoRAError(f"LoRA adapter {path!r} adapts only modules the served model does not run (e.g. "
                        f"{min(skipped)!r}).")
    if skipped:
        logger.info("LoRA adapter %r: %d module(s) the served model does not run are skipped (e.g. %s).", path,
                    len(skipped), min(skipped))
    if not pairs:
        raise LoRAError(f"LoRA adapter {path!r} holds no LoRA weights.")
    origin = _split_fused(pairs, expected, fused or {}, path)  # slice -> the fused module it came from
    # PEFT builds LoraConfig from this file: a missing lora_alpha is its field's default, 8 (not r)
    alpha_default = config.get("lora_alpha")
    if alpha_default is None:
        alpha_default = PEFT_DEFAULT_LORA_ALPHA
    use_rslora = bool(config.get("use_rslora", False))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    max_rank = 0
    for module, ab in sorted(pairs.items()):
        layer = _LAYER.search(module) if module not in expected else None
        if layer is not None and num_layers is not None and int(layer.group(1)) >= num_layers:
            # a deeper base model's adapter: no stage holds that layer, so none would refuse it (pipeline parallel
            # skipped it silently), and "only q/k/v/o ..." misnamed the cause
            raise LoRAError(f"Cannot load LoRA adapter {path!r}: it targets {module!r} but the base model has "
                            f"{num_layers} decoder layers (an adapter for another base model?).")
        if layer is not None and local_layers is not None and int(layer.group(1)) not in local_layers:
            continue
        if module not in expected:
            if any(h in module.rsplit(".", 1)[-1] for h in _EMBED_HINTS):
                why = "LoRA on the embedding or the LM head is not supported"
            else:
                why = "only q/k/v/o and gate/up/down projections of the base model can be adapted"
            raise LoRAError(f"Cannot load LoRA adapter {path!r}: it targets {module!r}; {why}.")
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"Cannot load LoRA adapter {path!r}: module {module!r} lacks its lora_"
                            f"{'B' if 'A' in ab else 'A'} weight.")
        a, b = ab["A"], ab["B"]
        in_features, out_features = expected[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"Cannot load LoRA adapter {path!r}: module {module!r} has lora_A {tuple(a.shape)} and "
                            f"lora_B {tuple(b.shape)}, which do not form a low-rank pair.")
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise LoRAError(f"Cannot load LoRA adapter {path!r}: module {module!r} maps {a.shape[1]} -> {b.shape[0]} "
                            f"features but the base model's maps {in_features} -> {out_features} (an adapter for "
                            "another base model?).")
        rank = a.shape[0]
        if rank > max_lora_rank:
            raise LoRAError(f"Cannot load LoRA adapter {path!r}: its rank {rank} is larger than max_lora_rank="
                            f"{max_lora_rank}; start the engine with --max-lora-rank {_next_rank(rank)} or more.")
        # PEFT matches alpha_pattern against the module it adapted (a fused one's own name)
        source = origin.get(module, module)
        alpha = float(_pattern_value(config.get("alpha_pattern"), renamed.get(source, source), alpha_default))
        scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        weights[module] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
        max_rank = max(max_rank, rank)
    return LoRAAdapter(lora_int_id=lora_int_id, name=name, path=path, rank=max_rank, weights=weights)


def _split_fused(pairs: dict[str, dict[str, torch.Tensor]], expected: dict[str, tuple[int, int]],
                 fused: dict[str, list[str]], path: str) -> dict[str, str]:
    """Replace, in place, each pair of a fused module (`fused`'s keys) by one pair per slice: B's rows in the
    slices' order, A shared. Returns slice name -> fused module name."""
    origin: dict[str, str] = {}
    for module in [m for m in pairs if m in fused and m not in expected]:
        ab = pairs[module]
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"Cannot load LoRA adapter {path!r}: module {module!r} lacks its lora_"
                            f"{'B' if 'A' in ab else 'A'} weight.")
        a, b = ab["A"], ab["B"]
        parts = fused[module]
        sizes = [expected[p][1] for p in parts]
        if b.dim() != 2 or b.shape[0] != sum(sizes):
            raise LoRAError(f"Cannot load LoRA adapter {path!r}: module {module!r} has lora_B {tuple(b.shape)} but "
                            f"the base model's maps to {sum(sizes)} features (an adapter for another base model?).")
        clash = [p for p in parts if p in pairs]
        if clash:
            raise LoRAError(f"Cannot load LoRA adapter {path!r}: it adapts both {module!r} and {clash[0]!r}.")
        del pairs[module]
        for part, b_part in zip(parts, torch.split(b, sizes, dim=0)):
            pairs[part] = {"A": a, "B": b_part}
            origin[part] = module
    return origin


def _next_rank(rank: int) -> int:
    return next(r for r in (8, 16, 32, 64, 128, 256, 320, 512, 1 << 30) if r >= rank)
