"""The linear method of the integer weight-only methods (GPTQ, AWQ, compressed-tensors W4A16/W8A16): their
checkpoint layout converted once to the internal layout (`packed.py`), on CUDA to the tiled one where it applies
(`tiled.py`), and the matmuls of `kernels.py` over it."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.kernels.qgemv_mma import dequantize_mma
from pagedllm.kernels.tiled_layout import dequantize_tiled
from pagedllm.quantization.base import LinearMethodBase
from pagedllm.quantization.kernels import mma_int_linear, packed_int_linear, tiled_int_linear
from pagedllm.quantization.packed import dequantize_packed
from pagedllm.quantization.tiled import use_mma_layout, use_tiled_layout


class PackedIntLinearMethod(LinearMethodBase):
    """apply() over the internal layout: the CUDA kernels where they apply, else dequantize-and-matmul.

    Subclasses register their checkpoint's parameters in `create_weights` and implement `convert(layer)`, which
    returns (qweight, scales, zeros, g_idx or None) in the internal layout; it runs once after loading."""

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits = bits
        self.group_size = group_size  # -1 already resolved to K by subclasses where needed

    def convert(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, scales, zeros, g_idx = self.convert(layer)
        for name, _ in list(layer.named_parameters(recurse=False)):
            if name != "bias":
                delattr(layer, name)
        layer.register_parameter("qweight", nn.Parameter(qweight.contiguous(), requires_grad=False))
        layer.register_parameter("scales", nn.Parameter(scales.to(layer.params_dtype).contiguous(),
                                                        requires_grad=False))
        layer.register_parameter("zeros", nn.Parameter(zeros.to(layer.params_dtype).contiguous(),
                                                       requires_grad=False))
        if g_idx is not None and not torch.equal(g_idx.long().cpu(), _trivial_g_idx(g_idx.numel(), self.group_size)):
            layer.register_parameter("g_idx", nn.Parameter(g_idx.to(torch.int32).contiguous(), requires_grad=False))
        else:
            layer.g_idx = None
        layer.quant_bits = self.bits
        layer.quant_group_size = self.group_size
        layer.quant_layout = "internal"
        if layer.qweight.is_cuda and not use_mma_layout(layer):
            use_tiled_layout(layer)

    def apply(self, layer, x, bias=None):
        if layer.quant_layout == "mma":
            return mma_int_linear(x, layer, bias)
        if layer.quant_layout == "tiled":
            return tiled_int_linear(x, layer, bias)
        return packed_int_linear(x, layer.qweight, layer.scales, layer.zeros, layer.quant_bits,
                                 layer.quant_group_size, layer.g_idx, bias)

    def dequantized_weight(self, layer):
        if layer.quant_layout == "mma":
            return dequantize_mma(layer.qweight, layer.scales, layer.zeros, layer.quant_group_size, layer.quant_perm)
        if layer.quant_layout == "tiled":
            return dequantize_tiled(layer.qweight, layer.scales, layer.zeros, layer.quant_bits,
                                    layer.quant_group_size, layer.quant_perm)
        return dequantize_packed(layer.qweight, layer.scales, layer.zeros, layer.quant_bits,
                                 layer.quant_group_size, layer.g_idx)


def _trivial_g_idx(k: int, group_size: int) -> torch.Tensor:
    return torch.arange(k) // group_size
