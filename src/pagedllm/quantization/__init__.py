"""Quantization methods: a registry of `QuantizationConfig` classes, imported lazily by name.

    resolve_quant_config(quantization, hf_config, model_dir) -> QuantizationConfig | None
        the method from `--quantization` and/or config.json's `quantization_config` (auto-detected), checked
        against each other; None for an unquantized model.
    register_quantization_config(name, module, class_name)   plug in a method (e.g. wt21's CPU GGUF)
    weight_memory_summary(model) -> str                      bytes of weights per linear method, for the log

Importing this package imports no method module; `base.py` holds the seam (QuantizationConfig, LinearMethodBase).
"""
from __future__ import annotations

import importlib
import json
import os
from typing import Any, Optional

# method name -> (module under pagedllm.quantization or a full dotted path, class name)
_METHODS: dict[str, tuple[str, str]] = {
    "awq": ("awq", "AWQConfig"),
    "compressed-tensors": ("compressed_tensors", "CompressedTensorsConfig"),
    "fp8": ("fp8", "Fp8Config"),
    "gptq": ("gptq", "GPTQConfig"),
    "int8": ("int8", "Int8Config"),
    "gguf": ("gguf", "GGUFConfig"),  # a .gguf's blocks kept packed on CPU (the default there; quantization/gguf.py)
    "modelopt": ("compressed_tensors", "ModelOptFp8Config"),  # NVIDIA ModelOpt FP8 (per-tensor, static)
}

# Spellings found in checkpoints / other engines' flags -> our name.
_ALIASES = {"compressed_tensors": "compressed-tensors", "w8a16": "int8", "int8_w8a16": "int8",
            # vLLM's kernel-specific names for the same checkpoints
            "gptq_marlin": "gptq", "awq_marlin": "awq", "fp8_e4m3": "fp8"}


def register_quantization_config(name: str, module: str, class_name: str) -> None:
    """Add (or override) a method; `module` is a full dotted path or a module name under pagedllm.quantization."""
    _METHODS[name] = (module, class_name)


def quantization_methods() -> list[str]:
    return sorted(_METHODS)


def normalize_method_name(name: str) -> str:
    name = str(name).strip().lower()
    return _ALIASES.get(name, name)


def get_quantization_config_class(name: str) -> type:
    name = normalize_method_name(name)
    if name not in _METHODS:
        raise ValueError(f"Unknown quantization method {name!r}; supported: {', '.join(quantization_methods())}.")
    module_name, class_name = _METHODS[name]
    if "." not in module_name:
        module_name = f"pagedllm.quantization.{module_name}"
    return getattr(importlib.import_module(module_name), class_name)


# AutoAWQ's own keys: a quantize config holding them (and no quant_method) is AWQ's, not AutoGPTQ's.
_AWQ_KEYS = ("w_bit", "q_group_size", "zero_point", "version")


def checkpoint_quant_config(hf_config: Any, model_dir: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The checkpoint's `quantization_config` (config.json), else AutoGPTQ's `quantize_config.json`, AutoAWQ's
    `quant_config.json` or ModelOpt's `hf_quant_config.json` (the files vLLM reads), else None."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    files = ("quantize_config.json", "quant_config.json", "hf_quant_config.json")
    for name in files if not qc and model_dir else ():
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    qc = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"{path} is not valid JSON ({e}).") from None
            if not isinstance(qc, dict):  # (a list or a number has no quant_method to read)
                raise ValueError(f"{path} must hold a JSON object (a quantize config), got "
                                 f"{type(qc).__name__}.")
            if name == "hf_quant_config.json":  # ModelOpt's: {"producer": {"name": "modelopt"}, "quantization": ..}
                qc.setdefault("quant_method", "modelopt")
            qc.setdefault("quant_method", "awq" if any(k in qc for k in _AWQ_KEYS) else "gptq")
            break
    return dict(qc) if qc else None


def resolve_quant_config(quantization: Optional[str], hf_config: Any, model_dir: Optional[str] = None) -> Any:
    """The model's QuantizationConfig, or None. A forced `quantization` must match the checkpoint's method;
    online methods (fp8, int8) quantize a float checkpoint and need no quantization_config."""
    ckpt = checkpoint_quant_config(hf_config, model_dir)
    ckpt_method = normalize_method_name(ckpt.get("quant_method", "")) if ckpt else None
    if quantization is None and ckpt is None:
        return None
    if quantization is None:
        quantization = _method_reading(ckpt_method)
        if quantization is None:
            raise ValueError(f"The checkpoint is quantized with {ckpt_method or 'an unnamed method'!r}, which "
                             f"pagedllm does not support; supported: {', '.join(quantization_methods())}.")
    cls = get_quantization_config_class(quantization)
    if ckpt is not None:
        if ckpt_method != cls.name and ckpt_method not in cls.checkpoint_names:
            raise ValueError(f"--quantization {normalize_method_name(quantization)} does not match the checkpoint, "
                             f"which is quantized with {ckpt_method!r}; drop --quantization (the method is read "
                             f"from config.json).")
        reader = getattr(cls, "checkpoint_reader", None)  # (module, class) reading the method's checkpoints
        if reader is not None:
            cls = getattr(importlib.import_module(f"pagedllm.quantization.{reader[0]}"), reader[1])
        return cls.from_config(ckpt)
    if not cls.online:
        raise ValueError(f"--quantization {cls.name} needs a {cls.name}-quantized checkpoint, but the model's "
                         f"config.json has no quantization_config; pass a {cls.name} checkpoint, or use an "
                         f"online method ({', '.join(_online_methods())}) on a float checkpoint.")
    return cls.from_config({})


def _method_reading(ckpt_method: Optional[str]) -> Optional[str]:
    """Our method that reads checkpoints of `quant_method` = ckpt_method (its own name or a listed one)."""
    if ckpt_method in _METHODS:
        return ckpt_method
    return next((n for n in _METHODS if ckpt_method in get_quantization_config_class(n).checkpoint_names), None)


def _online_methods() -> list[str]:
    return [n for n in quantization_methods() if get_quantization_config_class(n).online]


def quant_config_for_engine(args: Any, hf_config: Any, model_dir: str, device: Any, dtype: Any) -> Any:
    """resolve_quant_config for EngineArgs, plus the start-up refusals: this device / dtype, LoRA."""
    quant_config = resolve_quant_config(args.quantization, hf_config, model_dir)
    if quant_config is None:
        return None
    quant_config.check_supported(device, dtype)
    if getattr(args, "enable_lora", False) and not quant_config.supports_lora:
        raise ValueError(f"LoRA is not supported with quantization method {quant_config.name!r}; drop "
                         f"--enable-lora or use an unquantized model.")
    return quant_config


def weight_memory_summary(model: Any) -> str:
    """'1.23 GiB weights: 0.98 GiB gptq (196 layers), 0.25 GiB other' for the start-up log (parameters and
    buffers, grouped by the linear method of the module holding them; embeddings, norms, LM head: other)."""
    by_method: dict[str, list[int]] = {}
    seen: set[int] = set()
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        name = "other" if method is None else getattr(method, "method_name", None) \
            or type(method).__name__.replace("LinearMethod", "").lower()
        for p in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if id(p) in seen:
                continue
            seen.add(id(p))
            entry = by_method.setdefault(name, [0, 0])
            entry[0] += p.numel() * p.element_size()
        if method is not None:
            by_method.setdefault(name, [0, 0])[1] += 1
    total = sum(v[0] for v in by_method.values())
    parts = [f"{_size(v[0])} {k}" + (f" ({v[1]} layers)" if v[1] else "")
             for k, v in sorted(by_method.items(), key=lambda kv: -kv[1][0])]
    return f"{_size(total)} weights: " + ", ".join(parts)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
