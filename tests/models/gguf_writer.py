"""Tiny GGUFs written from the tests' tiny HF checkpoints with the `gguf` package, laid out as llama.cpp's
converter lays them out. The tables here are llama.cpp's names (convert_hf_to_gguf / gguf's tensor_mapping),
independent of pagedllm's. Not a test module.

    write_tiny_gguf   llama (Q/K rows permuted, llama3 rope_freqs), qwen2, qwen3 (yarn keys); chosen weights
                      quantized
    gguf_writer       the header every tiny file shares, and the file written when its block ends: the family
                      and MoE writers (test_gguf_families.py, test_moe_gguf.py) add their own keys and tensors
    checkpoint_tensors / llama_layer_tensor / add_tensor   the tensor loop's pieces
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any, Iterator, Optional

import numpy as np

# HF name (after model.layers.N.) -> llama.cpp tensor name (after blk.N.): llama / qwen2 / qwen3 and their MoE
# variants (router, Qwen2-MoE's shared expert); Gemma and Phi-3 name theirs in test_gguf_families.py.
LLAMA_LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}
# the tensors outside the decoder layers, whole names
GLOBAL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}


def read_config(hf_dir: str) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        return json.load(f)


def config_head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


@contextlib.contextmanager
def gguf_writer(path: str, arch: str, cfg: dict, head_dim: Optional[int] = None,
                rope_theta: Optional[float] = None) -> Iterator[Any]:
    """A gguf.GGUFWriter for `arch` holding the keys every tiny file has (layers, context, sizes, heads, RMS eps;
    bos / eos where cfg has them, key / value length and rope base where given); the caller adds the rest, and
    the file is written when the block ends."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope_theta is not None:
        writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "bos_token_id" in cfg:  # config-only files state none
        writer.add_bos_token_id(cfg["bos_token_id"])
        writer.add_eos_token_id(cfg["eos_token_id"])
    yield writer
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def checkpoint_tensors(hf_dir: str) -> Iterator[tuple[str, Optional[tuple[str, str, str]], np.ndarray]]:
    """(HF name, (layer, module, suffix) of a decoder layer's tensor or None, the data in float32) per tensor of
    the checkpoint: `model.layers.3.self_attn.q_proj.weight` -> ("3", "self_attn.q_proj", "weight")."""
    from safetensors.torch import load_file

    for name, tensor in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        parts = None
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, _, suffix = rest.rpartition(".")
            parts = (layer, module, suffix)
        yield name, parts, tensor.float().numpy()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation for its interleaved rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_layer_tensor(arch: str, cfg: dict, module: str, data: np.ndarray) -> np.ndarray:
    """A decoder layer's tensor as the converter stores it: the llama architecture's Q/K rows permuted."""
    if arch == "llama" and module == "self_attn.q_proj":
        return llama_cpp_permute(data, cfg["num_attention_heads"])
    if arch == "llama" and module == "self_attn.k_proj":
        return llama_cpp_permute(data, cfg["num_key_value_heads"])
    return data


def add_tensor(writer: Any, name: str, data: np.ndarray, qtype: Optional[int] = None, quantizer=None) -> None:
    """float32 when qtype is None, else quantized to that GGML type (by quantizer(data, qtype), default gguf's)."""
    if qtype is None:
        writer.add_tensor(name, data)
        return
    from gguf.quants import quantize

    writer.add_tensor(name, (quantizer or quantize)(data, qtype), raw_dtype=qtype)


def llama3_rope_freqs(theta, head_dim, p):
    """The divisors llama.cpp's converter stores as rope_freqs.weight for llama3 rope scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < p["original_max_position_embeddings"] / p["high_freq_factor"]:
            out.append(1.0)
        elif wavelen > p["original_max_position_embeddings"] / p["low_freq_factor"]:
            out.append(p["factor"])
        else:
            smooth = ((p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"])
                      / (p["high_freq_factor"] - p["low_freq_factor"]))
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def write_tiny_gguf(hf_dir: str, path: str, arch: str, kinds: Optional[dict] = None, quantizer=None,
                    identity: Optional[dict] = None, extra: Optional[dict] = None,
                    yarn_original_context: bool = True) -> None:
    """A llama / qwen2 / qwen3 checkpoint as a GGUF. kinds: GGML type per module ("self_attn.q_proj", ...;
    "token_embd" / "output" for the globals) for weights stored quantized (by quantizer(data, qtype), default
    gguf's quantizer); the rest float32. identity: general.* metadata (organization, basename, name, finetune).
    extra: more float32 tensors by GGUF name, written after the model's. A yarn rope is stated by its scaling keys;
    yarn_original_context False leaves out its original context length (llama.cpp then takes context_length)."""
    import gguf

    cfg = read_config(hf_dir)
    head_dim = config_head_dim(cfg)
    rope = cfg["rope_parameters"]
    with gguf_writer(path, arch, cfg, head_dim, rope["rope_theta"]) as writer:
        for key, value in (identity or {}).items():
            getattr(writer, f"add_{key}")(value)
        if rope.get("rope_type") == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            if yarn_original_context:
                writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            # as llama.cpp's converter names them
            for key, name in (("attention_factor", "attn_factor"), ("beta_fast", "beta_fast"),
                              ("beta_slow", "beta_slow")):
                if rope.get(key) is not None:
                    writer.add_float32(f"{arch}.rope.scaling.yarn_{name}", rope[key])
        if rope.get("rope_type") == "llama3":
            writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope["rope_theta"], head_dim, rope))
        for name, parts, data in checkpoint_tensors(hf_dir):
            if parts is not None:
                layer, module, suffix = parts
                data = llama_layer_tensor(arch, cfg, module, data)
                gguf_name = f"blk.{layer}.{LLAMA_LAYER_TENSORS[module]}.{suffix}"
                qtype = (kinds or {}).get(module) if suffix == "weight" else None
            else:
                gguf_name = GLOBAL_TENSORS[name]
                qtype = (kinds or {}).get(gguf_name.rsplit(".", 1)[0])
            add_tensor(writer, gguf_name, data, qtype, quantizer)
        for gguf_name, data in (extra or {}).items():
            add_tensor(writer, gguf_name, data)
