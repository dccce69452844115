"""`--quantization int8` on CPU through the integer kernels (kernels/csrc/gguf_ops.cpp, its int8-row format).

Each output row is stored as [float32 scale | K int8] in one uint8 buffer. On AVX-512 VNNI machines (rows a
multiple of 16, K of 32) the buffer is regrouped into the kernels' 16-row tiles (`kernels/gguf_ops.py:
tile_packed`, the same bytes) and `weight` becomes an empty int8 placeholder (`dequantized_weight` reads the
tiles); elsewhere `weight` is a view of the rows (no second copy). The product quantizes activations per 32
values like the GGUF path and multiplies with integer dot products.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.kernels.cpu_ops import cpu_ops
from pagedllm.kernels.gguf_ops import I8_ROW, gguf_matmul, required_ops, tile_packed


def pack_int8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] + float32 scale [N] -> uint8 [N, 4 + K] rows."""
    rows = torch.empty(q.shape[0], q.shape[1] + 4, dtype=torch.uint8)
    rows[:, :4] = scale.to(torch.float32).contiguous().view(torch.uint8).view(-1, 4)
    rows[:, 4:] = q.view(torch.uint8)
    return rows


def attach_w8a8(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> bool:
    """Give a CPU layer the packed rows (True), or leave it (False: not CPU, no kernels, fp16, tensor parallel)."""
    if q.device.type != "cpu" or getattr(layer, "tp_size", 1) != 1 or layer.params_dtype == torch.float16:
        return False
    if cpu_ops() is None:
        return False
    rows = pack_int8_rows(q, scale)
    packed, qtype = tile_packed(rows, I8_ROW)
    layer.register_buffer("w8a8_rows", packed, persistent=False)
    layer.__dict__["w8a8_type"] = qtype
    layer.__dict__["w8a8_shape"] = tuple(q.shape)
    if qtype == I8_ROW:
        layer.weight = nn.Parameter(rows[:, 4:].view(torch.int8), requires_grad=False)
    else:  # the tiles hold the only copy
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.int8), requires_grad=False)
    layer.register_buffer("weight_scale", scale.to(torch.float32), persistent=False)
    return True


def w8a8_linear(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return gguf_matmul(x, [layer.w8a8_rows], [layer.__dict__["w8a8_type"]], bias, layer.__dict__["w8a8_shape"][0])


def w8a8_dequantized(layer: nn.Module) -> torch.Tensor:
    """The layer's weights as float32 [N, K], from the rows or the tiles."""
    out = torch.empty(layer.__dict__["w8a8_shape"], dtype=torch.float32)
    required_ops().gguf_dequantize_rows(out, layer.w8a8_rows.detach().cpu(), layer.__dict__["w8a8_type"], None)
    return out


def w8a8_int8_values(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's int8 weights [N, K] and float32 scales [N] on the CPU, exactly as quantized, from the rows or
    the tiles (wherever the buffers now are)."""
    scale = layer.weight_scale.detach().to("cpu", torch.float32)
    weight = layer._parameters.get("weight")
    if weight is not None and weight.numel():
        return weight.detach().cpu(), scale
    rows = layer.w8a8_rows.detach().cpu()
    out = torch.empty(layer.__dict__["w8a8_shape"], dtype=torch.float32)
    required_ops().gguf_dequantize_rows(out, rows, layer.__dict__["w8a8_type"], None)
    # The tiles hold q * scale per row exactly (q in [-127, 127]): dividing gives q back.
    q = torch.round(out / scale.clamp(min=1e-30)[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale
