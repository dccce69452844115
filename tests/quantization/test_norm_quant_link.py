"""The wiring of a norm that quantizes its output for the W8A8 layer it feeds (layers/layernorm.link_norm_quant,
quantization.kernels.take_prequantized). The kernel runs on CUDA only (its numbers: tests/quantization/
interpret_int8.py in Triton's interpreter; the model on a GPU: tests/gpu/test_int8_w8a8_gpu.py), so here the CUDA-only
condition of the layer method is lifted to check which norms are linked and how a layer takes what was left."""
from __future__ import annotations

import torch

from pagedllm.layers import layernorm
from pagedllm.models.loader import load_model
from pagedllm.quantization.fp8 import FP8_DTYPE, Fp8LinearMethod
from pagedllm.quantization.kernels import take_prequantized


def test_norms_linked_to_the_layers_they_feed_alone(tiny_llama_dir, monkeypatch):
    model, _, _ = load_model(tiny_llama_dir, dtype=torch.float32, quantization="fp8")
    layers = model.model.layers
    assert all(layer.input_layernorm.quant_consumer is None for layer in layers)  # CPU: nothing linked at load
    monkeypatch.setattr(Fp8LinearMethod, "norm_quant_dtype", lambda self, layer: FP8_DTYPE)
    assert layernorm.link_norm_quant(model) == 2 * len(layers)
    for layer in layers:
        assert layer.input_layernorm.quant_consumer is layer.self_attn.qkv_proj
        assert layer.post_attention_layernorm.quant_consumer is layer.mlp.gate_up_proj
        assert layer.input_layernorm.quant_dtype == layer.post_attention_layernorm.quant_dtype == FP8_DTYPE
    assert model.model.norm.quant_consumer is None  # the final norm feeds the LM head, no W8A8 layer
    fresh, _, _ = load_model(tiny_llama_dir, dtype=torch.float32, quantization="fp8")
    monkeypatch.setattr(layernorm, "FUSE_NORM_QUANT", False)
    assert layernorm.link_norm_quant(fresh) == 0
    monkeypatch.setattr(Fp8LinearMethod, "norm_quant_dtype", lambda self, layer: None)  # e.g. a static input scale
    monkeypatch.setattr(layernorm, "FUSE_NORM_QUANT", True)
    assert layernorm.link_norm_quant(fresh) == 0


def test_prequantized_taken_for_that_tensor_once(tiny_llama_dir):
    model, _, _ = load_model(tiny_llama_dir, dtype=torch.float32, quantization="fp8")
    qkv = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, 64)
    quantized = (torch.zeros(3, 64, dtype=FP8_DTYPE), torch.ones(3, 1))
    qkv.__dict__["_prequantized"] = (x, quantized)
    assert take_prequantized(qkv, x.clone()) is None  # another tensor, equal values: not its input
    assert "_prequantized" not in qkv.__dict__  # and nothing stale is kept
    qkv.__dict__["_prequantized"] = (x, quantized)
    assert take_prequantized(qkv, x) is quantized
    assert take_prequantized(qkv, x) is None  # once
    # the layer's own quantization when nothing was left: the same output as fp8_linear on its input
    from pagedllm.quantization.kernels import fp8_linear

    want = fp8_linear(x, qkv.weight, qkv.weight_scale, qkv.bias)
    assert torch.equal(qkv(x), want)
