"""Mixture-of-experts GGUFs written here with the `gguf` package from the tiny HF checkpoints, laid out as
llama.cpp's converter lays them out (Mixtral as the llama architecture with expert_count and Q/K rows permuted;
qwen3moe; qwen2moe with its shared expert; experts stacked as ffn_{gate,up,down}_exps [E, rows, cols], or one
tensor per expert as older Mixtral files have them), round-tripped against the HF originals: the converted
directory (hub per-expert names, which transformers loads too), the CPU path reading the .gguf itself, and a
Q8_0 file whose experts and routers are dequantized at load while the attention stays packed."""
from __future__ import annotations

import re
from typing import Optional

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.models.loader import get_model, load_hf_config, prepare_model_dir
from pagedllm.models.qwen3_moe import is_sparse_layer
from tests.models.gguf_writer import (GLOBAL_TENSORS, LLAMA_LAYER_TENSORS, add_tensor, checkpoint_tensors,
                                      config_head_dim, gguf_writer, llama_layer_tensor, read_config)
from tests.models.moe_helpers import tiny_moe_dir  # noqa: F401 - the fixture

_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")
_EXPERT_KIND = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}


def write_moe_gguf(hf_dir: str, path: str, arch: str, per_expert: bool = False, qtype: Optional[int] = None,
                   expert_qtype: Optional[int] = None, quantizer=None) -> None:
    """qtype: the GGML type of every 2-D / 3-D weight (None: float32); expert_qtype: the experts' (default
    qtype); quantizer(data, qtype): the blocks' writer (default gguf's; it has none for the K-quants)."""
    expert_qtype = qtype if expert_qtype is None else expert_qtype
    cfg = read_config(hf_dir)
    gguf_arch = _GGUF_ARCH[arch]
    with gguf_writer(path, gguf_arch, cfg, config_head_dim(cfg), cfg["rope_parameters"]["rope_theta"]) as writer:
        writer.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if arch != "mixtral":
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if arch == "qwen2_moe":
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])

        def add(name: str, data: np.ndarray, kind: Optional[int] = qtype) -> None:
            if kind is not None and data.ndim == 3:  # stacked experts: quantized row by row
                blocks = add_rows(data.reshape(-1, data.shape[-1]), kind)
                writer.add_tensor(name, blocks.reshape(data.shape[0], data.shape[1], -1), raw_dtype=kind)
                return
            add_tensor(writer, name, data, kind if data.ndim >= 2 else None, quantizer=quantizer)

        def add_rows(rows: np.ndarray, kind: int) -> np.ndarray:
            from gguf.quants import quantize
            return (quantizer or quantize)(np.ascontiguousarray(rows), kind)

        experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
        for name, parts, data in checkpoint_tensors(hf_dir):
            if parts is None:
                add(GLOBAL_TENSORS[name], data)
                continue
            layer, module, suffix = parts
            match = _EXPERT.match(module)
            if match is not None:
                experts.setdefault((layer, _EXPERT_KIND[match[2]]), {})[int(match[1])] = data
                continue
            data = llama_layer_tensor(gguf_arch, cfg, module, data)
            if module == "mlp.shared_expert_gate":
                data = data.reshape(-1)  # llama.cpp's converter squeezes [1, H] to [H]
            add(f"blk.{layer}.{LLAMA_LAYER_TENSORS[module]}.{suffix}", data)
        for (layer, kind), by_expert in sorted(experts.items()):
            if per_expert:
                for e, data in sorted(by_expert.items()):
                    add(f"blk.{layer}.ffn_{kind}.{e}.weight", data, expert_qtype)
            else:
                add(f"blk.{layer}.ffn_{kind}_exps.weight", np.stack([by_expert[e] for e in sorted(by_expert)]),
                    expert_qtype)


def _hf_logits(model_dir: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(ids[None]).logits[0]


def _ours_logits(model_dir: str, ids: torch.Tensor) -> torch.Tensor:
    model = get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0])))


@pytest.mark.parametrize("arch,per_expert", [("mixtral", False), ("mixtral", True), ("qwen3_moe", False),
                                             ("qwen2_moe", False)])
def test_moe_gguf_round_trip(tmp_path, monkeypatch, tiny_moe_dir, arch, per_expert):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = tiny_moe_dir(arch)
    gguf_path = str(tmp_path / f"tiny-{arch}.gguf")
    write_moe_gguf(hf_dir, gguf_path, arch, per_expert=per_expert)
    converted = prepare_model_dir(gguf_path)
    source, config = load_hf_config(hf_dir), load_hf_config(converted)
    assert config.architectures == source.architectures
    for key in ("num_experts_per_tok", "intermediate_size", "moe_intermediate_size", "norm_topk_prob",
                "shared_expert_intermediate_size", "num_local_experts"):
        assert getattr(config, key, None) == getattr(source, key, None), key
    if arch != "mixtral":  # the same layers dense (a file lists them; decoder_sparse_step=2 becomes [0, 2])
        layers = range(source.num_hidden_layers)
        assert [is_sparse_layer(config, i) for i in layers] == [is_sparse_layer(source, i) for i in layers]
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))
    ref = _hf_logits(hf_dir, ids)
    torch.testing.assert_close(_ours_logits(converted, ids), ref, atol=1e-4, rtol=1e-4)
    # the converted directory is an ordinary hub-layout checkpoint: transformers reads it as well
    torch.testing.assert_close(_hf_logits(converted, ids), ref, atol=1e-5, rtol=1e-5)


def test_engine_reads_the_moe_gguf_itself(tmp_path, monkeypatch, tiny_moe_dir):
    """A .gguf on the CPU loads through the packed-GGUF path (its tensors read from the file, experts stacked):
    transformers' greedy tokens."""
    from tests.engine.test_correctness import hf_greedy, random_prompts

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = tiny_moe_dir("qwen2_moe")
    gguf_path = str(tmp_path / "tiny.gguf")
    write_moe_gguf(hf_dir, gguf_path, "qwen2_moe")
    llm = LLM(model=gguf_path, num_gpu_blocks_override=64, skip_tokenizer_init=True)
    assert llm.engine.worker.quant_config.name == "gguf"
    prompts = random_prompts([3, 17, 30], seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_dir, p, 8)[0] for p in prompts]


def test_q8_0_moe_gguf_keeps_attention_packed_and_dequantizes_experts(tmp_path, monkeypatch, tiny_moe_dir, caplog):
    import gguf

    from pagedllm.quantization.gguf import GGUFLinearMethod

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = str(tmp_path / "tiny-q8.gguf")
    write_moe_gguf(tiny_moe_dir("mixtral"), gguf_path, "mixtral", qtype=gguf.GGMLQuantizationType.Q8_0)
    with caplog.at_level("INFO", logger="pagedllm"):
        packed = LLM(model=gguf_path, num_gpu_blocks_override=64, skip_tokenizer_init=True)
    # 2 layers x (router + gate, up, down experts)
    assert any("8 mixture-of-experts tensor(s)" in r.getMessage() for r in caplog.records)
    dense = LLM(model=gguf_path, quantization="none", num_gpu_blocks_override=64, skip_tokenizer_init=True)
    layer = packed.engine.worker.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.linear_method, GGUFLinearMethod)
    assert isinstance(layer.mlp.experts, FusedMoE) and layer.mlp.experts.gate_up_proj.dtype == torch.float32
    dense_layer = dense.engine.worker.model.model.layers[0]
    # the same Q8_0 blocks dequantized by the packed path's reader and by the conversion
    assert torch.equal(layer.mlp.experts.gate_up_proj, dense_layer.mlp.experts.gate_up_proj)
    assert torch.equal(layer.mlp.gate.weight, dense_layer.mlp.gate.weight)
    ids = list(range(5, 45))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    a, b = (llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].prompt_logprobs[1:]
            for llm in (packed, dense))
    # packed Q8_0 attention quantizes its activations to int8: close to the dequantized float path, not equal
    err = max(abs(pa[t].logprob - pb[t].logprob) for pa, pb in zip(a, b) for t in set(pa) & set(pb))
    assert err < 0.05, err
