"""FP8 W8A8: online `--quantization fp8` (a float checkpoint's weights become per-channel E4M3 at load time) and
the layer method that compressed-tensors FP8 checkpoints share.

    weight E4M3 [N, K], weight_scale fp32 [N] (per output channel); activations: dynamic per-token E4M3 scales
    (or one static input scale from the checkpoint). y = (x_q @ w_q^T) * x_scale * w_scale + b
On CUDA (FP8 tensor cores: compute capability >= 8.9) the product is the Triton FP8 GEMM of kernels/w8a8_gemm.py
for a few rows and one `torch._scaled_mm` above; on a CPU it is emulated in fp32 with the same quantized values
(correct, slow).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm import envs
from pagedllm.layers.activation import triton_kernels
from pagedllm.quantization.base import (LinearMethodBase, QuantizationConfig, create_float_weight,
                                        set_quant_param_attrs)
from pagedllm.quantization.kernels import FP8_DTYPE, FP8_MAX, fp8_linear, take_prequantized

FP8_MIN_CAPABILITY = 89


class Fp8Config(QuantizationConfig):
    name = "fp8"
    online = True
    min_capability = FP8_MIN_CAPABILITY
    supports_lora = True

    # quant_method "fp8" checkpoints are AutoFP8's per-tensor ones (compressed_tensors.AutoFp8Config reads them; it
    # imports this module) or transformers' block-wise ones (refused)
    checkpoint_reader = ("compressed_tensors", "AutoFp8Config")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Fp8Config":
        refuse_blockwise_fp8(config)
        if config:
            raise ValueError("FP8 checkpoints are read by AutoFp8Config (Fp8Config.checkpoint_reader).")
        return cls()

    def get_linear_method(self, layer: nn.Module, prefix: str) -> Optional[LinearMethodBase]:
        return Fp8OnlineLinearMethod()

    def check_supported(self, device: torch.device, act_dtype: torch.dtype) -> None:
        super().check_supported(device, act_dtype)
        check_fp8_gpu_dtype(self.name, device, act_dtype)


def refuse_blockwise_fp8(config: dict[str, Any]) -> None:
    if config.get("weight_block_size") is not None:  # transformers' FineGrainedFP8 (128x128 block scales)
        raise ValueError("Block-wise FP8 checkpoints (quant_method 'fp8', weight_block_size "
                         f"{config.get('weight_block_size')}) are not supported; use a compressed-tensors FP8 "
                         "checkpoint or --quantization fp8 on the bf16 model.")


def check_fp8_gpu_dtype(name: str, device: torch.device, act_dtype: torch.dtype) -> None:
    """fp16 / fp32 FP8 layers need the Triton GEMM on CUDA: torch._scaled_mm's row-wise scaling (per-token x
    per-channel) produces bf16 only."""
    if device.type == "cuda" and act_dtype != torch.bfloat16 and triton_kernels("w8a8_gemm") is None:
        raise ValueError(f"Quantization method {name!r} (FP8 W8A8) computes in bfloat16 on the GPU without the "
                         f"Triton kernels (PAGEDLLM_USE_TRITON_KERNELS=0 or no triton); pass --dtype bfloat16 "
                         f"instead of {str(act_dtype).replace('torch.', '')}.")


def quantize_weight_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (E4M3 [N, K], fp32 scale [N])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def add_w8a8_counters(layer: nn.Module) -> None:
    """The layer's split-K arrival counters for the CUDA W8A8 GEMM (`kernels/w8a8_gemm.counters_for`), where that
    GEMM runs (a CUDA weight, the Triton kernels on); elsewhere none (the product is not split)."""
    kernels = triton_kernels("w8a8_gemm") if layer.weight.is_cuda else None
    if kernels is not None:
        layer.register_buffer("w8a8_counters", kernels.counters_for(layer.weight.shape[0], layer.weight.device),
                              persistent=False)


class Fp8LinearMethod(LinearMethodBase):
    """apply() over (weight E4M3 [N, K], weight_scale fp32 [N], optional static input_scale)."""

    def apply(self, layer, x, bias=None):
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, getattr(layer, "input_scale", None),
                          getattr(layer, "w8a8_counters", None), prequantized=take_prequantized(layer, x))

    def norm_quant_dtype(self, layer) -> Optional[torch.dtype]:
        """The dtype an RMSNorm whose output feeds this layer alone quantizes that output into, in its own kernel
        (per token, dynamic: layers/layernorm.link_norm_quant), or None: dynamic activations on CUDA only."""
        if layer.weight.is_cuda and getattr(layer, "input_scale", None) is None and envs.PAGEDLLM_FUSED_ACT_QUANT:
            return FP8_DTYPE
        return None

    def dequantized_weight(self, layer):
        return layer.weight.float() * layer.weight_scale[:, None]


class Fp8OnlineLinearMethod(Fp8LinearMethod):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        create_float_weight(layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader)

    def process_weights_after_loading(self, layer):
        q, scale = quantize_weight_fp8_per_channel(layer.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.register_buffer("weight_scale", scale, persistent=False)
        layer.input_scale = None
        add_w8a8_counters(layer)
