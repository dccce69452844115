"""GGUF round trips of the Gemma 2, Gemma 3 and Phi-3 families: tiny GGUFs written here with llama.cpp's tensor
names and conventions (Gemma's norms stored as 1 + w and its ffn_norm being the pre-feed-forward norm; Phi-3's
fused attn_qkv / ffn_up and its LongRoPE factor tensors), converted and loaded by pagedllm, against transformers'
model of the same weights; the same files with quantized blocks kept packed on the CPU against their dequantized
twin; and the converter's config rules that the file does not state (Gemma's query scale, layer pattern)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import get_model, load_hf_config, prepare_model_dir
from tests.models.gguf_writer import (GLOBAL_TENSORS, add_tensor, checkpoint_tensors, config_head_dim, gguf_writer,
                                      read_config)

# HF name (after model.layers.N.) -> llama.cpp tensor name (after blk.N.), per family; independent of pagedllm's
# tables (llama.cpp's convert_hf_to_gguf / gguf's tensor_mapping).
_GEMMA = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_PHI3 = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
         "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_family_gguf(hf_dir: str, path: str, arch: str, kinds: Optional[dict] = None,
                      gemma2_defaults: bool = False) -> None:
    """The HF checkpoint in hf_dir as llama.cpp's converter writes it for arch (gemma2 | gemma3 | phi3). kinds: GGML
    type per GGUF tensor kind ("attn_q", "token_embd", ...) for weights stored quantized; the rest float32.
    gemma2_defaults: Gemma 2's window and soft-caps left out (llama.cpp's defaults stand in)."""
    import gguf

    cfg = read_config(hf_dir)
    head_dim = config_head_dim(cfg)
    rope = cfg["rope_parameters"]
    gemma = arch in ("gemma2", "gemma3")
    rope_theta = rope["full_attention"]["rope_theta"] if arch == "gemma3" else rope["rope_theta"]
    with gguf_writer(path, arch, cfg, head_dim if gemma else None, rope_theta) as writer:
        if gemma:
            if not gemma2_defaults:
                writer.add_sliding_window(cfg["sliding_window"])
            if arch == "gemma2":
                if not gemma2_defaults:
                    writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
                    writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
            elif rope["full_attention"]["rope_type"] == "linear":
                writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
        else:
            writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
            writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
            writer.add_sliding_window(cfg.get("sliding_window") or 0)
            if rope.get("rope_type") == "longrope":
                writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
                writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        table = _PHI3 if arch == "phi3" else _GEMMA
        for name, parts, data in checkpoint_tensors(hf_dir):
            if parts is not None:
                layer, module, suffix = parts
                gguf_name = f"blk.{layer}.{table[module]}.{suffix}"
            else:
                gguf_name = GLOBAL_TENSORS[name]
            if gemma and gguf_name.endswith("norm.weight"):
                data = data + 1.0  # llama.cpp stores Gemma's (1 + w)
            kind = gguf_name.split(".")[-2]
            qtype = (kinds or {}).get(kind) if gguf_name.endswith(".weight") and "norm" not in kind else None
            add_tensor(writer, gguf_name, data, qtype)


def _assert_logits_match(hf_dir: str, config, converted: str) -> None:
    """pagedllm's model from the converted GGUF gives transformers' fp32 logits (of the checkpoint the file was
    written from) on 40 random tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))
    ours = get_model(config, converted, dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(40)))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def _family_dir(tiny_model_dir, arch: str) -> str:
    # A GGUF does not store query_pre_attn_scalar: llama.cpp uses head_dim below the 27B models, so the tiny Gemmas
    # here have that value (the tiny default, 24, is checked against transformers in test_families.py).
    return tiny_model_dir(arch, query_pre_attn_scalar=32) if arch.startswith("gemma") else tiny_model_dir(arch)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_family_gguf_round_trip(tmp_path, fresh_cache, tiny_model_dir, arch):
    hf_dir = _family_dir(tiny_model_dir, arch)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_family_gguf(hf_dir, path, arch)
    converted = prepare_model_dir(path)
    source, config = load_hf_config(hf_dir), load_hf_config(converted)
    assert config.architectures == source.architectures and config.tie_word_embeddings == source.tie_word_embeddings
    keys = {"gemma2": ("head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types", "attn_logit_softcapping",
                       "final_logit_softcapping", "hidden_activation"),
            "gemma3": ("head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types", "hidden_activation",
                       "rope_parameters"),
            "phi3": ("original_max_position_embeddings", "max_position_embeddings")}[arch]
    for key in keys:
        assert getattr(config, key) == getattr(source, key), key
    if arch == "phi3":  # LongRoPE factors and the rotated fraction from the factor tensors and rope.dimension_count
        got, want = config.rope_parameters, source.rope_parameters
        assert {k: got[k] for k in ("rope_type", "partial_rotary_factor", "rope_theta")} == \
            {k: want[k] for k in ("rope_type", "partial_rotary_factor", "rope_theta")}
        np.testing.assert_allclose(got["long_factor"], want["long_factor"], rtol=1e-6)
        np.testing.assert_allclose(got["short_factor"], want["short_factor"], rtol=1e-6)
    # phi3: 40 tokens > the original context of 32, where transformers and pagedllm (max_model_len 256) use the
    # long factors; gemma: within the window (512), which the file states
    _assert_logits_match(hf_dir, config, converted)


def test_gemma2_gguf_without_window_and_caps_takes_llama_cpps_defaults(tmp_path, fresh_cache, tiny_model_dir):
    """A Gemma 2 GGUF without attention.sliding_window / attn_logit_softcapping / final_logit_softcapping: llama.cpp
    runs it with Gemma 2's 4096 / 50 / 30. The converter set None (no window, no caps): other logits than the file's
    model; now transformers' Gemma 2 with those values."""
    hf_dir = tiny_model_dir("gemma2", query_pre_attn_scalar=32, sliding_window=4096, attn_logit_softcapping=50.0,
                            final_logit_softcapping=30.0)
    path = str(tmp_path / "tiny-gemma2-defaults.gguf")
    write_family_gguf(hf_dir, path, "gemma2", gemma2_defaults=True)
    converted = prepare_model_dir(path)
    config = load_hf_config(converted)
    assert (config.sliding_window, config.attn_logit_softcapping, config.final_logit_softcapping) == (4096, 50, 30)
    _assert_logits_match(hf_dir, config, converted)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_family_gguf_packed_matches_its_dequantized_twin(tmp_path, fresh_cache, tiny_model_dir, arch):
    """Q8_0 / Q4_0 / Q5_0 blocks kept packed (Phi-3's fused qkv and gate_up as one packed part each, the Gemma norms
    float): greedy tokens and logprobs equal the same file dequantized at load, in a mixed batch."""
    import gguf

    from pagedllm.quantization.gguf import GGUFLinearMethod
    Q = gguf.GGMLQuantizationType
    hf_dir = _family_dir(tiny_model_dir, arch)
    path = str(tmp_path / f"packed-{arch}.gguf")
    kinds = {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q4_0, "attn_qkv": Q.Q8_0, "attn_output": Q.Q5_0,
             "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_0, "token_embd": Q.Q8_0, "output": Q.Q8_0}
    write_family_gguf(hf_dir, path, arch, kinds)
    packed = LLM(model=path, num_gpu_blocks_override=64, skip_tokenizer_init=True)
    dense = LLM(model=path, quantization="none", num_gpu_blocks_override=64, skip_tokenizer_init=True)
    model = packed.engine.worker.model
    linears = [m for m in model.modules() if hasattr(m, "linear_method")]
    assert linears and all(isinstance(m.linear_method, GGUFLinearMethod) for m in linears)
    assert "gguf_type" in model.model.embed_tokens.__dict__
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, 500, n).tolist() for n in (3, 17, 45)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
    a = packed.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    b = dense.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lx = [x.outputs[0].logprobs[i][t].logprob for i, t in enumerate(x.outputs[0].token_ids)]
        ly = [y.outputs[0].logprobs[i][t].logprob for i, t in enumerate(y.outputs[0].token_ids)]
        torch.testing.assert_close(torch.tensor(lx), torch.tensor(ly), atol=2e-3, rtol=0)
    # Phi-3's layers are Llama's, the Gemmas' Gemma's: their decode steps ran the one-call C++ stack (partial rotary,
    # LongRoPE's cache; Gemma 2's soft cap, Gemma 3's two rope bases)
    assert type(model.model.fast_path.stack).__name__ == "DecodeStack"


def _config_only_gguf(path: str, arch: str, layers: int, pattern=None) -> None:
    """Metadata and a token embedding only: enough for the converter's config."""
    cfg = {"num_hidden_layers": layers, "max_position_embeddings": 128, "hidden_size": 96, "intermediate_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6}  # no bos / eos
    with gguf_writer(path, arch, cfg, head_dim=16, rope_theta=10000.0) as writer:
        writer.add_sliding_window(8)
        if pattern is not None:
            writer.add_sliding_window_pattern(pattern)
        writer.add_tensor("token_embd.weight", np.zeros((32, 96), dtype=np.float32))


@pytest.mark.parametrize("arch,layers,scalar", [("gemma2", 46, 24), ("gemma2", 26, 16), ("gemma3", 62, 24),
                                                ("gemma3", 18, 16)])
def test_gemma_query_scale_follows_llama_cpp(tmp_path, arch, layers, scalar):
    """The 27B models (46 / 62 layers) scale queries by hidden / heads (96 / 4 here), the others by head_dim (16),
    as their HF configs' query_pre_attn_scalar says (144 and 168 for the real 27Bs)."""
    from pagedllm.models.gguf import build_hf_config, open_gguf

    path = str(tmp_path / "c.gguf")
    _config_only_gguf(path, arch, layers)
    config = build_hf_config(open_gguf(path))
    assert config.query_pre_attn_scalar == scalar
    period = 2 if arch == "gemma2" else 6
    assert config.layer_types == ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                                  for i in range(layers)]


def test_gemma3_sliding_window_pattern_from_the_file(tmp_path):
    from pagedllm.models.gguf import build_hf_config, open_gguf

    path = str(tmp_path / "p.gguf")
    _config_only_gguf(path, "gemma3", 4, pattern=[True, False, True, True])
    assert build_hf_config(open_gguf(path)).layer_types == [
        "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    _config_only_gguf(path, "gemma3", 6, pattern=3)
    assert build_hf_config(open_gguf(path)).layer_types == ["sliding_attention", "sliding_attention",
                                                            "full_attention"] * 2
