"""Quantized mixture-of-experts checkpoints: every format either loads correctly or is refused at load time in one
sentence naming the model and the format, never a crash inside the experts' loaders or silently wrong weights.

    HF checkpoints with a quantization_config (GPTQ, AWQ, FP8, compressed-tensors; AutoGPTQ's quantize_config.json)
        refused before anything is built: the experts have no quantized kernels
    online --quantization fp8 / int8 on the float checkpoint
        loads: attention quantized, experts and routers kept in --dtype (equal to the checkpoint's)
    GGUF files with quantized experts (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K)
        load: the experts dequantized at load, equal to the gguf package's own dequantization, on the packed CPU
        path and the converted (dequantized) path alike; greedy tokens of the two agree."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.models.loader import load_model
from tests.models.moe_helpers import MOE_ARCHS, tiny_moe_dir  # noqa: F401 - the fixture

_CLASS = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
QUANT_CONFIGS = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
             "gptq (4-bit, group size 128)"),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
            "awq (4-bit, group size 128)"),
    # transformers' FineGrainedFP8 (Qwen3-30B-A3B-FP8's layout) and a per-tensor one
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                  "fp8 (weight blocks [128, 128])"),
    "fp8": ({"quant_method": "fp8", "activation_scheme": "static"}, "fp8"),
    "compressed-tensors": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                        "strategy": "group", "group_size": 128}}},
        "ignore": ["lm_head"]}, "compressed-tensors (format pack-quantized)"),
}


def _with_quant_config(src: str, dst: str, quantization_config: dict, in_config: bool = True) -> str:
    """The float checkpoint with a quantization_config added: if the loader read on, the float expert tensors
    would load under a quantized method's parameters (or crash there) - the refusal must come first."""
    shutil.copytree(src, dst)
    if in_config:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = quantization_config
        with open(path, "w") as f:
            json.dump(cfg, f)
    else:  # AutoGPTQ's separate file
        with open(os.path.join(dst, "quantize_config.json"), "w") as f:
            json.dump({k: v for k, v in quantization_config.items() if k != "quant_method"}, f)
    return dst


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("fmt", sorted(QUANT_CONFIGS))
def test_quantized_moe_checkpoint_is_refused_naming_model_and_format(tmp_path, tiny_moe_dir, arch, fmt):
    qc, described = QUANT_CONFIGS[fmt]
    model_dir = _with_quant_config(tiny_moe_dir(arch), str(tmp_path / f"{arch}-{fmt}"), qc)
    with pytest.raises(ValueError) as err:
        LLM(model=model_dir, num_gpu_blocks_override=16, skip_tokenizer_init=True)
    message = str(err.value)
    assert message.startswith(f"{model_dir} ({_CLASS[arch]}) is a mixture-of-experts checkpoint quantized with "
                              f"{described}, which pagedllm cannot load yet"), message
    assert "\n" not in message


def test_autogptq_quantize_config_file_is_refused_too(tmp_path, tiny_moe_dir):
    qc, _ = QUANT_CONFIGS["gptq"]
    model_dir = _with_quant_config(tiny_moe_dir("mixtral"), str(tmp_path / "mixtral-gptq"), qc, in_config=False)
    with pytest.raises(ValueError, match=r"\(MixtralForCausalLM\) is a mixture-of-experts checkpoint quantized "
                                         r"with gptq \(4-bit, group size 128\)"):
        load_model(model_dir, dtype=torch.float32)


def test_forced_method_on_a_moe_model_built_directly_is_refused(tiny_moe_dir):
    """get_model with a checkpoint method's config (no loader check before it) still refuses in the constructor."""
    from pagedllm.models.loader import get_model, load_hf_config
    from pagedllm.quantization.gptq import GPTQConfig

    model_dir = tiny_moe_dir("qwen3_moe")
    qc = GPTQConfig.from_config(QUANT_CONFIGS["gptq"][0])
    with pytest.raises(ValueError, match=r"\(Qwen3MoeForCausalLM\) is a mixture-of-experts checkpoint quantized "
                                         r"with gptq, which pagedllm cannot load yet"):
        get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, quant_config=qc)


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_online_quantization_keeps_experts_in_dtype(tiny_moe_dir, arch, method):
    from safetensors.torch import load_file

    model_dir = tiny_moe_dir(arch)
    quantized, _, _ = load_model(model_dir, dtype=torch.float32, quantization=method)
    plain, _, _ = load_model(model_dir, dtype=torch.float32)
    layer = next(m for m in quantized.model.layers if isinstance(getattr(m.mlp, "experts", None), FusedMoE))
    assert type(layer.self_attn.qkv_proj.linear_method).__name__ != "UnquantizedLinearMethod"
    index = quantized.model.layers.index(layer) if hasattr(quantized.model.layers, "index") else \
        list(quantized.model.layers).index(layer)
    ckpt = load_file(os.path.join(model_dir, "model.safetensors"))
    prefix = "block_sparse_moe" if arch == "mixtral" else "mlp"
    w1, w3 = ("w1", "w3") if arch == "mixtral" else ("gate_proj", "up_proj")
    inter = layer.mlp.experts.intermediate_size
    gate = ckpt[f"model.layers.{index}.{prefix}.experts.3.{w1}.weight"]
    up = ckpt[f"model.layers.{index}.{prefix}.experts.3.{w3}.weight"]
    assert layer.mlp.experts.gate_up_proj.dtype == torch.float32
    assert torch.equal(layer.mlp.experts.gate_up_proj[3, :inter], gate)
    assert torch.equal(layer.mlp.experts.gate_up_proj[3, inter:], up)
    # the reference: the float model with every quantized layer's weight replaced by its dequantized values
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if type(getattr(module, "linear_method", None)).__name__ not in ("NoneType", "UnquantizedLinearMethod"):
                plain.get_submodule(name).weight.copy_(module.linear_method.dequantized_weight(module))
    ids = torch.randint(2, 512, (24,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a = quantized.compute_logits(quantized(ids, torch.arange(24)))
        b = plain.compute_logits(plain(ids, torch.arange(24)))
    # int8 on CPU: activations as two int8 digits (~16-bit); fp8: activations rounded to E4M3 (3 mantissa bits)
    # per token as well, through every layer of this tiny random model
    bound = 2e-3 if method == "int8" else 0.3
    assert (a - b).abs().max() < bound * b.abs().max(), (a - b).abs().max()


def _gguf_expert_reference(path: str, layer: int, kind: str) -> torch.Tensor:
    """The gguf package's own dequantization of blk.{layer}.ffn_{kind}_exps: [E, rows, cols] float32."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    tensor = next(t for t in GGUFReader(path).tensors if t.name == f"blk.{layer}.ffn_{kind}_exps.weight")
    data = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    return torch.from_numpy(data.reshape([int(n) for n in reversed(tensor.shape)]))


@pytest.mark.parametrize("expert_type", ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_gguf_moe_with_quantized_experts_loads_them_dequantized(tmp_path, monkeypatch, tiny_moe_dir, expert_type):
    import gguf

    from tests.models.test_moe_gguf import write_moe_gguf
    from tests.quantization.test_gguf_cpu import _kquant_blocks
    Q = gguf.GGMLQuantizationType
    qtype = Q[expert_type]
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    k_quant = expert_type.endswith("_K")
    # K-quant rows are 256 wide: the expert matrices' inputs (hidden, intermediate) must be multiples of 256
    hf_dir = tiny_moe_dir("mixtral", hidden_size=256, intermediate_size=256) if k_quant else tiny_moe_dir("mixtral")
    path = str(tmp_path / f"moe-{expert_type}.gguf")

    def quantizer(data: np.ndarray, kind: int) -> np.ndarray:
        return _kquant_blocks(data, kind) if kind in (Q.Q4_K, Q.Q6_K) else gguf.quants.quantize(data, kind)

    write_moe_gguf(hf_dir, path, "mixtral", qtype=Q.Q8_0, expert_qtype=qtype, quantizer=quantizer)
    packed = LLM(model=path, num_gpu_blocks_override=64, skip_tokenizer_init=True)
    dense = LLM(model=path, quantization="none", num_gpu_blocks_override=64, skip_tokenizer_init=True)
    assert packed.engine.worker.quant_config.name == "gguf" and dense.engine.worker.quant_config is None
    for llm in (packed, dense):
        experts = llm.engine.worker.model.model.layers[1].mlp.experts
        gate, up, down = (_gguf_expert_reference(path, 1, kind) for kind in ("gate", "up", "down"))
        assert torch.equal(experts.gate_up_proj.data, torch.cat([gate, up], dim=1))
        assert torch.equal(experts.down_proj.data, down)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    a = packed.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    b = dense.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for x, y in zip(a, b):
        # the packed path's Q8_0 attention quantizes its activations: logprobs close, tokens equal on this model
        lx = [x.outputs[0].logprobs[i][t].logprob for i, t in enumerate(x.outputs[0].token_ids)]
        ly = [y.outputs[0].logprobs[i][t].logprob for i, t in enumerate(x.outputs[0].token_ids)]
        assert max(abs(p - q) for p, q in zip(lx, ly)) < 0.05
