"""Online --quantization fp8: per-channel E4M3 weights, dynamic per-token E4M3 activations (CPU emulation),
against transformers with the same quantization applied by plain torch; refusals."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.models.loader import load_hf_config, load_model
from pagedllm.quantization import resolve_quant_config
from tests.quantization.checkpoints import hf_model

PROMPT = torch.randint(2, 512, (32,), generator=torch.Generator().manual_seed(17))
E4M3 = torch.float8_e4m3fn


def _fp8_reference(model_dir):
    """transformers with every linear (not lm_head) as W8A8 FP8: weights per output row, inputs per token."""
    model = hf_model(model_dir)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and "lm_head" not in name:
            w = module.weight.data
            scale = w.abs().amax(1, keepdim=True) / 448
            module.weight.data = (w / scale).to(E4M3).float() * scale

            def fake_quant_input(m, inputs):
                x = inputs[0]
                s = (x.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
                return ((x / s).to(E4M3).float() * s,)
            module.register_forward_pre_hook(fake_quant_input)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_online_fp8_matches_reference(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    ours, _, _ = load_model(model_dir, dtype=torch.float32, quantization="fp8")
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == E4M3
    with torch.inference_mode():
        got = ours.compute_logits(ours(PROMPT, torch.arange(len(PROMPT))))
        want = _fp8_reference(model_dir)(PROMPT[None]).logits[0]
        plain = hf_model(model_dir)(PROMPT[None]).logits[0]
    err = (got - want).abs().mean()
    assert err < 1e-3 and (got - want).abs().max() < 0.05, err
    assert err < 0.2 * (got - plain).abs().mean()  # the quantization is real, and ours is the same one


def test_fp8_on_a_gpu_without_fp8_is_refused(monkeypatch, tiny_llama_dir):
    qc = resolve_quant_config("fp8", load_hf_config(tiny_llama_dir))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="'fp8' needs a GPU of compute capability >= 8.9, this one is 8.0"):
        qc.check_supported(torch.device("cuda"), torch.bfloat16)


def test_fp8_in_fp16_on_a_gpu_needs_the_triton_kernels(monkeypatch, tiny_llama_dir):
    """fp16 FP8 layers run the Triton GEMM at every size (torch._scaled_mm's row-wise scales give bf16 only), so
    fp16 is refused only where those kernels are off."""
    import pagedllm.quantization.fp8 as fp8

    qc = resolve_quant_config("fp8", load_hf_config(tiny_llama_dir))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    qc.check_supported(torch.device("cuda"), torch.float16)
    qc.check_supported(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setattr(fp8, "triton_kernels", lambda module: None)
    with pytest.raises(ValueError, match="computes in bfloat16 on the GPU without the Triton kernels .*"
                                         "pass --dtype bfloat16 instead of float16"):
        qc.check_supported(torch.device("cuda"), torch.float16)
    qc.check_supported(torch.device("cuda"), torch.bfloat16)


def test_blockwise_fp8_checkpoint_is_refused():
    from pagedllm.quantization.fp8 import Fp8Config
    with pytest.raises(ValueError, match="Block-wise FP8 checkpoints"):
        Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})


def _autofp8_checkpoint(src: str, dst: str, preset: str, activation_scheme: str):
    """An AutoFP8 checkpoint (neuralmagic's *-FP8 format): the compressed-tensors library's per-tensor FP8 tensors
    (same values, same names), each scale a 0-d tensor as AutoFP8 saves it, and AutoFP8's quantization_config."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    from tests.quantization.checkpoints import ct_checkpoint
    model_dir, reference = ct_checkpoint(src, dst, preset)
    path = os.path.join(model_dir, "model.safetensors")
    tensors = {k: v.reshape(()) if k.endswith("_scale") else v for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": activation_scheme,
                                     "ignored_layers": ["lm_head"]}
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return model_dir, reference


@pytest.mark.parametrize("arch", ["qwen2", "phi3_plain"])  # Phi-3: 0-d scales of whole fused qkv / gate_up
def test_autofp8_checkpoint_matches_reference(tmp_path, caplog, tiny_model_dir, arch):
    """AutoFP8's per-tensor checkpoints (quant_method "fp8", activation_scheme "static", no weight_block_size)
    were refused as "block-wise FP8 checkpoints (weight_block_size None)": they load, every scale read, and compute
    what the compressed-tensors library computes for the same static FP8 tensors."""
    model_dir, reference = _autofp8_checkpoint(tiny_model_dir(arch), str(tmp_path / "fp8"), "FP8", "static")
    check_static_fp8_checkpoint(model_dir, reference, caplog)


def check_static_fp8_checkpoint(model_dir: str, reference, caplog) -> None:
    """A static per-tensor FP8 checkpoint loads with its weights in E4M3 and its input scales, no tensor ignored,
    and its logits are those of the reference model (the compressed-tensors library's dequantized one)."""
    ours, _, _ = load_model(model_dir, dtype=torch.float32)
    assert not [r for r in caplog.records if "Ignoring" in r.getMessage()]
    layer = ours.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.input_scale is not None
    prompt = torch.randint(2, 512, (40,), generator=torch.Generator().manual_seed(13))
    with torch.inference_mode():
        got = ours.compute_logits(ours(prompt, torch.arange(40)))
        want = reference(prompt[None]).logits[0]
    # (as test_compressed_tensors.test_w8a8_schemes: activation rounding makes last-bit differences visible)
    assert (got - want).abs().max() < 0.05 and (got - want).abs().mean() < 1e-3


def test_fp8_checkpoint_options_not_read_are_refused():
    import types

    def resolve(qc):
        return resolve_quant_config(None, types.SimpleNamespace(quantization_config=qc), None)

    with pytest.raises(ValueError, match="activation_scheme='per-head'"):
        resolve({"quant_method": "fp8", "activation_scheme": "per-head"})
    with pytest.raises(ValueError, match="fmt='e5m2'"):
        resolve({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e5m2"})
    with pytest.raises(ValueError, match="Block-wise FP8 checkpoints"):
        resolve({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    config = resolve({"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert config.name == "fp8" and [s.act_dynamic for s in config.schemes] == [True]
