"""GGUF (llama.cpp) -> Hugging Face checkpoint directory, converted once and cached.

The converted directory holds config.json, generation_config.json (with the sampling defaults a known
model's authors recommend, since a GGUF carries none: generation_config.recommended_sampling), tokenizer files
(with the chat template) and float32 safetensors (sharded past ~2 GB), so everything downstream (loader, tokenizer,
chat template) sees an ordinary HF model directory.

Weights are dequantized with `gguf.quants.dequantize`; llama.cpp's converter permutes the Q/K rows of
`llama`-architecture models for its interleaved rope, so those are permuted back to HF's rotate-half layout
(qwen2/qwen3/gemma2/gemma3/phi3 use neox rope in llama.cpp and are stored unpermuted). Gemma's norm weights are
stored as 1 + w (ggml's norm multiplies by its weight), so 1 is subtracted back, as transformers' GGUF loader does.
Per architecture the tensor names differ where the layouts do (`_ARCH_LAYER_TENSORS`): Gemma's `ffn_norm` is the
pre-feed-forward norm, Phi-3's `attn_qkv` / `ffn_up` are its fused qkv_proj / gate_up_proj.

Cache layout: `<PAGEDLLM_CACHE_DIR>/gguf/<file stem>-<key>/` where key hashes (converter version, absolute
path, size, mtime). A conversion is written to a temporary sibling and renamed into place, so the cache
never holds a half-written model.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any, Iterator, Optional

import numpy as np

from pagedllm import envs
from pagedllm.generation_config import SOURCE_KEY, recommended_sampling

logger = logging.getLogger(__name__)

# 2: generation_config.json also holds a known model's recommended sampling defaults.
CONVERTER_VERSION = 2
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3",
                               "phi3")  # llama: also Mixtral
MAX_SHARD_BYTES = 2 * 1024 ** 3

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Mixture of experts. Expert tensors are stacked over experts in the file ([E, rows, cols]); these names are the
# stacked ones the MoE models load directly (models/moe.py). The conversion to a HF directory writes the hub's
# per-expert tensors instead (`_hub_expert_tensors`), so transformers reads it too.
_MOE_LAYER_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_LAYER_TENSORS.update(_MOE_LAYER_TENSORS)
# Mixtral GGUFs from before llama.cpp stacked the experts (2024-04): blk.N.ffn_gate.E.weight, one per expert.
_PER_EXPERT_TENSORS = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_GEMMA_LAYER_TENSORS = {**_LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                        "post_attention_norm": "post_attention_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_TENSORS = {
    "gemma2": _GEMMA_LAYER_TENSORS,
    "gemma3": _GEMMA_LAYER_TENSORS,
    # Phi-3's up tensor holds [gate; up] (2 x feed_forward_length rows), as the HF checkpoint's gate_up_proj.
    "phi3": {**_LAYER_TENSORS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_GEMMA_ARCHS = ("gemma2", "gemma3")
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# folded into config.json's rope parameters instead (llama3's rope_freqs; Phi-3's LongRoPE factors)
_SKIPPED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def gguf_cache_dir(gguf_path: str) -> str:
    """Where the converted HF directory for this exact file (path, size, mtime) lives."""
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    key = hashlib.sha256(f"{CONVERTER_VERSION}|{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(envs.PAGEDLLM_CACHE_DIR, "gguf", f"{stem}-{key}")


def convert_gguf_to_hf(gguf_path: str) -> str:
    """Return the cached HF directory for `gguf_path`, converting on the first call."""
    out_dir = gguf_cache_dir(gguf_path)
    if os.path.isdir(out_dir):
        return out_dir
    reader = open_gguf(gguf_path)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    start = time.perf_counter()
    logger.info("Converting GGUF %s to a Hugging Face checkpoint in %s (done once, then cached).", gguf_path,
                out_dir)
    try:
        config = build_hf_config(reader)
        config.save_pretrained(tmp_dir)
        _write_generation_config(reader, config, tmp_dir)
        _write_tokenizer(reader, gguf_path, tmp_dir)
        write_safetensors(_iter_hf_tensors(reader, config), tmp_dir, len(reader.tensors))
        with open(os.path.join(tmp_dir, "pagedllm_gguf_source.json"), "w") as f:
            st = os.stat(gguf_path)
            json.dump({"gguf_path": os.path.abspath(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "converter_version": CONVERTER_VERSION}, f, indent=2)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            if not os.path.isdir(out_dir):  # not "another process won the race"
                raise
            shutil.rmtree(tmp_dir, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("Converted %s in %.1f s.", os.path.basename(gguf_path), time.perf_counter() - start)
    return out_dir


def open_gguf(gguf_path: str) -> Any:
    """A GGUFReader; ValueError in one sentence if the file is not a readable GGUF."""
    from gguf import GGUFReader
    try:
        reader = GGUFReader(gguf_path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on bad input
        raise ValueError(f"Could not read {gguf_path} as a GGUF file (is it corrupt or truncated?): "
                         f"{type(e).__name__}: {e}") from None
    check_not_split(gguf_path, _field(reader, "split.count"), _field(reader, "split.no"))
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} in {gguf_path} is not supported; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}.")
    return reader


def check_not_split(gguf_path: str, count: Any, number: Any) -> None:
    """A part of a split GGUF (llama.cpp's gguf-split: NAME-00001-of-0000N.gguf) holds only some tensors (the later
    parts no metadata): it was converted as if whole and failed on "missing" weights or an architecture None."""
    if count is not None and int(count) > 1:
        raise ValueError(f"{gguf_path} is part {int(number or 0) + 1} of a GGUF split into {int(count)} files; "
                         f"pagedllm reads single-file GGUFs: merge the parts with `llama-gguf-split --merge "
                         f"FIRST_PART.gguf MERGED.gguf` and pass the merged file.")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    from gguf import GGUFValueType
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    if field.types and field.types[0] == GGUFValueType.FLOAT32:
        value = float(str(np.float32(value)))  # shortest repr: 1e-05, not 9.999999747378752e-06
    return value


# ----------------------------------------------------------------------------------------------- config

def build_hf_config(reader: Any) -> Any:
    """A transformers config (Llama / Mixtral / Qwen2(Moe) / Qwen3(Moe) / Gemma2 / Gemma3Text / Phi3Config) from the
    GGUF metadata and tensor shapes."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    arch = _field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}

    def meta(suffix: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{suffix}", default)

    num_heads = int(meta("attention.head_count"))
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer list in some files; these archs use one value
        num_kv_heads = max(num_kv_heads)
    hidden_size = int(meta("embedding_length"))
    if arch == "phi3":  # rope.dimension_count is the rotated part (Phi-4-mini: 96 of 128)
        head_dim = int(meta("attention.key_length", 0) or hidden_size // num_heads)
    else:
        head_dim = int(meta("attention.key_length", 0) or meta("rope.dimension_count", 0) or
                       hidden_size // num_heads)
    rope_theta = float(meta("rope.freq_base", 10000.0))
    max_position = int(meta("context_length", 2048))
    kwargs: dict[str, Any] = dict(
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # GGUF shapes are [hidden, vocab]
        hidden_size=hidden_size,
        intermediate_size=int(meta("feed_forward_length") or meta("expert_feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(num_kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=max_position,
        rope_theta=rope_theta,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    rope_scaling = _rope_scaling(reader, arch, tensors, rope_theta, head_dim)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    if arch in ("qwen2moe", "qwen3moe") or (arch == "llama" and meta("expert_count")):
        config = _moe_config(arch, meta, tensors, kwargs)
    elif arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config = LlamaConfig(architectures=["LlamaForCausalLM"], **kwargs)
    elif arch == "qwen2":
        config = Qwen2Config(architectures=["Qwen2ForCausalLM"], **kwargs)
    elif arch == "qwen3":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config = Qwen3Config(architectures=["Qwen3ForCausalLM"], **kwargs)
    elif arch in _GEMMA_ARCHS:
        config = _gemma_config(reader, arch, kwargs)
    else:
        config = _phi3_config(reader, tensors, kwargs)
    _set_config_dtype(config, _source_dtype(reader))
    return config


def _moe_config(arch: str, meta: Any, tensors: dict, kwargs: dict) -> Any:
    """Mixtral (llama architecture with experts), Qwen2-MoE or Qwen3-MoE. A layer without a router tensor is
    dense (Qwen-MoE's mlp_only_layers); llama.cpp renormalizes the top-k weights of Mixtral and Qwen3-MoE and not
    Qwen2-MoE's unless the file says otherwise (expert_weights_norm)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    experts = dict(num_experts_per_tok=int(meta("expert_used_count")))
    if arch == "llama":
        return MixtralConfig(architectures=["MixtralForCausalLM"], num_local_experts=int(meta("expert_count")),
                             sliding_window=None, **experts, **kwargs)
    dense = [i for i in range(kwargs["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    experts.update(num_experts=int(meta("expert_count")), mlp_only_layers=dense, decoder_sparse_step=1,
                   moe_intermediate_size=int(meta("expert_feed_forward_length")))
    if arch == "qwen3moe":
        return Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], attention_bias="blk.0.attn_q.bias" in tensors,
                              norm_topk_prob=bool(meta("expert_weights_norm", True)), **experts, **kwargs)
    return Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"], qkv_bias="blk.0.attn_q.bias" in tensors,
                          norm_topk_prob=bool(meta("expert_weights_norm", False)),
                          shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length", 0) or 0),
                          **experts, **kwargs)


def _layer_types(reader: Any, arch: str, num_layers: int, default_pattern: int) -> list[str]:
    """Local (sliding_attention) and global layers: the file's sliding_window_pattern (a period, or one flag per
    layer) else llama.cpp's fixed period for the architecture (Gemma 2: 2, Gemma 3: 6; the last of each period
    is global)."""
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        local = [bool(p) for p in pattern][:num_layers]
    else:
        local = [i % int(pattern) < int(pattern) - 1 for i in range(num_layers)]
    return ["sliding_attention" if is_local else "full_attention" for is_local in local]


def _gemma_config(reader: Any, arch: str, kwargs: dict[str, Any]) -> Any:
    from transformers import Gemma2Config, Gemma3TextConfig

    def meta(suffix: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{suffix}", default)

    layers, head_dim = kwargs["num_hidden_layers"], kwargs["head_dim"]
    # llama.cpp scales queries by hidden / heads for the 27B models (46 / 62 layers) and head_dim otherwise,
    # which is what their configs' query_pre_attn_scalar says; the file does not store it.
    big = layers == (46 if arch == "gemma2" else 62)
    # Keys a Gemma 2 file may leave out: llama.cpp then takes Gemma 2's window (4096) and soft-caps (50 / 30)
    gemma2 = arch == "gemma2"
    kwargs.update(
        query_pre_attn_scalar=kwargs["hidden_size"] // kwargs["num_attention_heads"] if big else head_dim,
        sliding_window=meta("attention.sliding_window", 4096 if gemma2 else None),
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=meta("final_logit_softcapping", 30.0 if gemma2 else None),
        attn_logit_softcapping=meta("attn_logit_softcapping", 50.0 if gemma2 else None),
        layer_types=_layer_types(reader, arch, layers, 2 if gemma2 else 6))
    if arch == "gemma2":
        return Gemma2Config(architectures=["Gemma2ForCausalLM"], **kwargs)
    # The local layers' base: the file's freq_base_swa, else the 10 000 every Gemma 3 uses (llama.cpp's default).
    kwargs["rope_local_base_freq"] = float(meta("rope.freq_base_swa", 10000.0))
    return Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **kwargs)


def _phi3_config(reader: Any, tensors: dict, kwargs: dict[str, Any]) -> Any:
    from transformers import Phi3Config

    rotary_dim = int(_field(reader, "phi3.rope.dimension_count", 0) or kwargs["head_dim"])
    if rotary_dim != kwargs["head_dim"]:
        kwargs["partial_rotary_factor"] = rotary_dim / kwargs["head_dim"]
    original = _field(reader, "phi3.rope.scaling.original_context_length")
    kwargs["original_max_position_embeddings"] = int(original or kwargs["max_position_embeddings"])
    kwargs["sliding_window"] = _field(reader, "phi3.attention.sliding_window") or None  # 0: none (Phi-4)
    if "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors:
        from gguf.quants import dequantize

        def factors(name: str) -> list[float]:
            t = tensors[name]
            return [float(x) for x in dequantize(t.data, t.tensor_type).reshape(-1)]

        kwargs["rope_scaling"] = {"rope_type": "longrope", "long_factor": factors("rope_factors_long.weight"),
                                  "short_factor": factors("rope_factors_short.weight")}
    return Phi3Config(architectures=["Phi3ForCausalLM"], **kwargs)


def _rope_scaling(reader: Any, arch: str, tensors: dict, rope_theta: float, head_dim: int) -> Optional[dict]:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        # llama.cpp takes the trained context (context_length) when the file states no original one
        original = _field(reader, f"{arch}.rope.scaling.original_context_length") or \
            _field(reader, f"{arch}.context_length", 2048)
        params = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
        # what llama.cpp's converter writes from the HF config's attention_factor / beta_fast / beta_slow
        for key, hf_key in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                            ("yarn_beta_slow", "beta_slow")):
            value = _field(reader, f"{arch}.rope.scaling.{key}")
            if value is not None:
                params[hf_key] = float(value)
        return params
    if "rope_freqs.weight" in tensors:
        from gguf.quants import dequantize
        t = tensors["rope_freqs.weight"]
        return _llama3_params_from_rope_freqs(dequantize(t.data, t.tensor_type).reshape(-1), rope_theta, head_dim)
    if kind in (None, "none") or (kind in ("linear", "yarn") and not factor):
        return None  # (no factor: nothing to scale)
    if kind == "longrope" and arch == "phi3" and "rope_factors_long.weight" in tensors:
        return None  # Phi-3's LongRoPE factors come from its tensors (_phi3_config)
    # Serving it with plain rope would quietly degrade every prompt past the original context.
    raise ValueError(f"The GGUF's rope scaling type {kind!r} ({arch}.rope.scaling.type) is not supported; "
                     f"supported: linear, yarn, Llama 3's rope_freqs and Phi-3's LongRoPE factors.")


def _llama3_params_from_rope_freqs(rope_freqs: np.ndarray, base: float, head_dim: int) -> dict:
    """Recover HF llama3 rope parameters from llama.cpp's per-frequency divisors.

    llama.cpp stores f_i = inv_freq_i / inv_freq_llama3_i: 1 for short wavelengths, `factor` for long ones
    and, between, 1/f = (1 - s)/factor + s with s = (C/wavelen - low)/(high - low), C the original context.
    s is linear in 1/wavelen, and only its slope C/(high-low) and intercept -low/(high-low) affect the
    frequencies, so fixing low = 1 (as every Llama 3.x does) makes C and high exact from two in-between
    frequencies. Too few of those: fall back to Llama 3's (C=8192, low=1, high=4).
    """
    freqs = rope_freqs.astype(np.float64)
    factor = float(freqs.max())
    inv_freq = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))[:len(freqs)]
    inv_wavelen = inv_freq / (2 * np.pi)
    medium = (freqs > 1 + 1e-4) & (freqs < factor - 1e-4)
    original, low, high = 8192, 1.0, 4.0
    if medium.sum() >= 2 and factor > 1:
        s = (1.0 / freqs[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(inv_wavelen[medium], s, 1)
        if slope > 0 and intercept < 0:
            original = int(round(-slope / intercept))  # from low = -intercept * C / slope = 1
            high = round(1.0 + original / slope, 4)
    else:
        logger.warning("GGUF rope_freqs has too few interpolated frequencies to fit; assuming Llama 3's rope "
                       "scaling constants (original context 8192, low/high frequency factors 1/4).")
    return {"rope_type": "llama3", "factor": round(factor, 4), "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original}


def _source_dtype(reader: Any) -> str:
    """The float type the model was most likely trained/served in: F16/BF16/F32 if stored so, else bf16."""
    from gguf import GGMLQuantizationType as Q
    kinds = {t.tensor_type for t in reader.tensors if len(t.shape) == 2}
    if kinds == {Q.F32}:
        return "float32"
    if kinds <= {Q.F16, Q.F32}:
        return "float16"
    return "bfloat16"


def _set_config_dtype(config: Any, dtype: str) -> None:
    # transformers >= 5 names the field `dtype`, older versions `torch_dtype`.
    setattr(config, "dtype" if "dtype" in config.to_dict() else "torch_dtype", dtype)


# ----------------------------------------------------------------------------------------- tokenizer etc.

def _write_generation_config(reader: Any, config: Any, out_dir: str) -> None:
    from transformers import GenerationConfig
    eos_ids = [config.eos_token_id] if config.eos_token_id is not None else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = _field(reader, key)
        if extra is not None and extra not in eos_ids:
            eos_ids.append(extra)
    sampling: dict[str, Any] = {}
    known = recommended_sampling(*(_field(reader, f"general.{key}")
                                   for key in ("organization", "basename", "name", "finetune")))
    if known is not None:
        sampling = dict(known.values, do_sample=True, **{SOURCE_KEY: known.source})
        logger.info("Sampling defaults for %s, as recommended by %s: %s", _field(reader, "general.name"),
                    known.source, known.values)
    GenerationConfig(bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
                     eos_token_id=eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
                     **sampling).save_pretrained(out_dir)


def _write_tokenizer(reader: Any, gguf_path: str, out_dir: str) -> None:
    if "tokenizer.ggml.model" not in reader.fields:
        logger.warning("%s has no tokenizer metadata; the converted model has no tokenizer.", gguf_path)
        return
    from transformers import AutoTokenizer
    logger.info("Building the tokenizer from the GGUF metadata.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                                  gguf_file=os.path.basename(gguf_path))
    except Exception as e:
        raise ValueError(f"Could not build a tokenizer from the metadata of {gguf_path}: "
                         f"{type(e).__name__}: {e}") from None
    template = _field(reader, "tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)


# ------------------------------------------------------------------------------------------------ weights

def _hf_name(gguf_name: str, arch: Optional[str] = None) -> Optional[str]:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if base.startswith("blk."):
        _, layer, tensor = base.split(".", 2)
        hf = _ARCH_LAYER_TENSORS.get(arch, _LAYER_TENSORS).get(tensor)
        if hf is None and tensor.rpartition(".")[0] in _PER_EXPERT_TENSORS and tensor.rpartition(".")[2].isdigit():
            kind, _, expert = tensor.rpartition(".")
            hf = f"mlp.experts.{expert}.{_PER_EXPERT_TENSORS[kind]}"
        return f"model.layers.{layer}.{hf}.{suffix}" if hf else None
    hf = _GLOBAL_TENSORS.get(base)
    return f"{hf}.{suffix}" if hf else None


def is_moe_dense_tensor(hf_name: str) -> bool:
    """Tensors the MoE models hold in float whatever the file's type (routers, experts, the shared expert's gate):
    the CPU path that keeps GGUF blocks packed dequantizes them at load (models/gguf_packed.py)."""
    return ".mlp.experts." in hf_name or hf_name.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight"))


def moe_tensor_shape(hf_name: str, data: np.ndarray) -> np.ndarray:
    """llama.cpp's converter squeezes Qwen2-MoE's shared expert gate [1, H] to [H]; HF's shape back."""
    if hf_name.endswith(".mlp.shared_expert_gate.weight") and data.ndim == 1:
        return data.reshape(1, -1)
    return data


_MIXTRAL_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL_HUB_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _hub_expert_tensors(name: str, data: np.ndarray, architecture: str) -> Iterator[tuple[str, np.ndarray]]:
    """The hub's names for a tensor: stacked experts split into one tensor per expert; Mixtral's block is
    `block_sparse_moe`, its experts' gate / up / down `w1` / `w3` / `w2`."""
    head, sep, tail = name.rpartition(".mlp.experts.")
    if sep and tail in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        for e in range(data.shape[0]):  # copies: safetensors refuses tensors that share memory
            yield from _hub_expert_tensors(f"{head}.mlp.experts.{e}.{tail}", data[e].copy(), architecture)
        return
    if architecture == "MixtralForCausalLM":
        match = _MIXTRAL_EXPERT.match(name)
        if match is not None:
            name = f"{match[1]}.block_sparse_moe.experts.{match[2]}.{_MIXTRAL_HUB_NAMES[match[3]]}.weight"
        elif name.endswith(".mlp.gate.weight"):
            name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    yield name, data


def to_hf_layout(arch: str, name: str, data: np.ndarray, config: Any, packed: bool = False) -> np.ndarray:
    """A GGUF tensor (dequantized, or its packed rows) under HF name `name` -> the HF checkpoint's values/rows:
    llama's Q/K rows unpermuted (a row permutation, so packed rows too), Gemma's 1 + w norms back to w."""
    if arch == "llama" and ".self_attn.q_proj." in name:
        return _unpermute_rope_rows(data, config.num_attention_heads)
    if arch == "llama" and ".self_attn.k_proj." in name:
        return _unpermute_rope_rows(data, config.num_key_value_heads)
    if arch in _GEMMA_ARCHS and name.endswith("norm.weight"):
        if packed:
            raise ValueError(f"{name}: a Gemma norm weight must be a float tensor")
        return data - np.float32(1.0)
    return data


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: per head, rows interleaved (pairs) -> two halves (HF rotate_half)."""
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"


def _iter_hf_tensors(reader: Any, config: Any) -> Iterator[tuple[str, np.ndarray]]:
    from gguf.quants import dequantize
    arch = _field(reader, "general.architecture")
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED_TENSORS:
            continue
        name = _hf_name(tensor.name, arch)
        if name is None:  # reported by every load of the file, not once here (the conversion is cached)
            continue
        try:
            data = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            # (Q8_K, I8 / I16 / I32, F64: llama.cpp's types for intermediate buffers or integer data, which gguf
            # does not dequantize; a type newer than the installed gguf would be read by a newer one)
            raise ValueError(f"GGUF tensor {tensor.name} is stored as {tensor.tensor_type.name}, which the installed "
                             f"gguf package ({_gguf_version()}) cannot dequantize into weights; re-export the model "
                             f"with a weight type such as Q4_K, Q8_0, F16 or BF16 (or, for a type newer than this "
                             f"gguf, upgrade it).") from None
        # numpy shape is GGUF's reversed: [out, in] like HF.
        data = np.array(data, dtype=np.float32)  # an owned, writable copy (not a view of the memmap)
        data = to_hf_layout(arch, name, data, config)
        yield from _hub_expert_tensors(name, moe_tensor_shape(name, data), config.architectures[0])


def write_safetensors(tensors: Iterator[tuple[str, np.ndarray]], out_dir: str, total: Optional[int] = None,
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Save tensors as `model.safetensors`, or shards + `model.safetensors.index.json` past max_shard_bytes."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    shard_names: list[str] = []
    weight_map: dict[str, int] = {}
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        name = f"shard-{len(shard_names)}.safetensors"
        save_file(pending, os.path.join(out_dir, name), metadata={"format": "pt"})
        shard_names.append(name)
        pending, pending_bytes = {}, 0

    bar = tqdm(total=total, desc="Dequantizing GGUF", unit="tensor", leave=False,
               disable=envs.PAGEDLLM_DISABLE_PROGRESS_BARS)
    for name, array in tensors:
        if pending and pending_bytes + array.nbytes > max_shard_bytes:
            flush()
        pending[name] = torch.from_numpy(array)
        pending_bytes += array.nbytes
        weight_map[name] = len(shard_names)
        bar.update(1)
    bar.close()
    if pending or not shard_names:
        flush()
    if len(shard_names) == 1:
        os.rename(os.path.join(out_dir, shard_names[0]), os.path.join(out_dir, "model.safetensors"))
        return
    final = [f"model-{i + 1:05d}-of-{len(shard_names):05d}.safetensors" for i in range(len(shard_names))]
    for old, new in zip(shard_names, final):
        os.rename(os.path.join(out_dir, old), os.path.join(out_dir, new))
    index = {"metadata": {}, "weight_map": {name: final[i] for name, i in weight_map.items()}}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
