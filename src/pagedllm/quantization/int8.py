"""Online `--quantization int8` (W8A16): a float checkpoint's linear weights become int8 at load time, one
symmetric fp32 scale per output channel; activations stay in the model dtype.

    y = (x @ W_q^T) * scale + b        W_q = round(W / scale) in [-127, 127], scale = max|W_row| / 127
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.quantization.base import (LinearMethodBase, QuantizationConfig, create_float_weight,
                                        set_quant_param_attrs)


class Int8Config(QuantizationConfig):
    name = "int8"
    online = True
    supports_lora = True  # LoRA adds its own float delta; the base weight's storage does not matter

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Int8Config":
        return cls()

    def get_linear_method(self, layer: nn.Module, prefix: str) -> Optional[LinearMethodBase]:
        return Int8LinearMethod()


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], fp32 scale [out]) with symmetric per-row scales."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8LinearMethod(LinearMethodBase):
    """Loads the float weight as the unquantized method does, then quantizes it in place."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        create_float_weight(layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader)

    def process_weights_after_loading(self, layer):
        q, scale = quantize_per_channel_int8(layer.weight.data)
        from pagedllm.quantization.cpu_w8a8 import attach_w8a8
        if attach_w8a8(layer, q, scale):  # CPU: rows for the integer kernels, `weight` a view of them
            return
        self._device_layout(layer, q, scale)

    @staticmethod
    def _device_layout(layer, q: torch.Tensor, scale: torch.Tensor) -> None:
        """The layout of a layer off the CPU kernels: on CUDA the 8-bit layout of quantization/packed.py (the
        Triton dequant kernel streams it), elsewhere int8 [out, in] + per-row scales."""
        for name in ("weight", "qweight", "scales", "zeros"):
            layer._parameters.pop(name, None)
        for name in ("weight_scale", "w8a8_rows"):
            layer._buffers.pop(name, None)
        if q.is_cuda:
            from pagedllm.quantization.packed import pack_int32

            layer.qweight = nn.Parameter(pack_int32(q.t().to(torch.int32) + 128, 8, dim=0).contiguous(),
                                         requires_grad=False)
            layer.scales = nn.Parameter(scale[None, :].to(layer.params_dtype), requires_grad=False)
            layer.zeros = nn.Parameter(torch.full_like(layer.scales, 128), requires_grad=False)
            return
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.register_buffer("weight_scale", scale, persistent=False)

    def _leave_cpu_kernels(self, layer) -> None:
        """A layer loaded on the CPU (its weights in the integer kernels' rows or tiles) whose model was then
        moved to another device: rebuild that device's layout from the same int8 values, once."""
        from pagedllm.quantization.cpu_w8a8 import w8a8_int8_values
        device = layer.w8a8_rows.device
        q, scale = w8a8_int8_values(layer)
        self._device_layout(layer, q.to(device), scale.to(device))

    def apply(self, layer, x, bias=None):
        rows = layer._buffers.get("w8a8_rows")
        if rows is not None:
            if rows.device.type == "cpu":
                from pagedllm.quantization.cpu_w8a8 import w8a8_linear
                return w8a8_linear(layer, x, bias)
            self._leave_cpu_kernels(layer)
        from pagedllm.quantization.kernels import int8_linear, packed_int_linear

        if "qweight" in layer._parameters:
            return packed_int_linear(x, layer.qweight, layer.scales, layer.zeros, 8, x.shape[-1], None, bias)
        return int8_linear(x, layer.weight, layer.weight_scale, bias)

    def dequantized_weight(self, layer):
        if "w8a8_rows" in layer._buffers:
            from pagedllm.quantization.cpu_w8a8 import w8a8_dequantized
            return w8a8_dequantized(layer)
        if "qweight" in layer._parameters:
            from pagedllm.quantization.packed import dequantize_packed
            return dequantize_packed(layer.qweight, layer.scales, layer.zeros, 8, layer.qweight.shape[0] * 4)
        return layer.weight.float() * layer.weight_scale[:, None]
