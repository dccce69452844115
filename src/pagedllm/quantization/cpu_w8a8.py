"""`--quantization int8` on CPU through the integer kernels (kernels/csrc/gguf_ops.cpp, its int8-row format).

Each output row is stored as [float32 scale | K int8] in one uint8 buffer; the layer's int8 `weight` becomes a
view of it (no second copy), so `Int8LinearMethod`'s other paths and `dequantized_weight` keep working. The
product quantizes activations per 32 values like the GGUF path and multiplies with integer dot products.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

I8_ROW = 1000  # the kernels' id for the per-channel int8 row format


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
    from pagedllm.kernels.cpu_ops import cpu_ops
    if cpu_ops() is None:
        return False
    rows = pack_int8_rows(q, scale)
    layer.register_buffer("w8a8_rows", rows, persistent=False)
    layer.weight = nn.Parameter(rows[:, 4:].view(torch.int8), requires_grad=False)
    layer.register_buffer("weight_scale", scale.to(torch.float32), persistent=False)
    return True


def w8a8_linear(x: torch.Tensor, rows: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    from pagedllm.quantization.gguf import gguf_matmul
    return gguf_matmul(x, [rows], [I8_ROW], bias, rows.shape[0])
