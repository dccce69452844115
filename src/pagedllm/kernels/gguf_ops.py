"""The Python side of the quantized-row CPU kernels (kernels/csrc/gguf_ops.cpp): their type ids, the 16-row tiled
layout, and the matmul / embedding entry points over packed rows.

Two callers store weights in these formats: GGUF blocks kept packed (`quantization/gguf.py`, and the embedding / LM
head in `layers/vocab_embedding.py`) and `--quantization int8` on CPU (`quantization/cpu_w8a8.py`, the I8_ROW
format). A leaf: it imports only the C++ op loader and the environment switches.
"""
from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

import torch

from pagedllm import envs
from pagedllm.kernels.cpu_ops import cpu_ops

I8_ROW = 1000  # the kernels' id for the per-channel int8 row format: [float32 scale | K int8] per output row

_HAVE_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def required_ops() -> Any:
    """The CPU op namespace; a RuntimeError saying what to do when the kernels are unavailable."""
    ops = cpu_ops()
    if ops is None:
        raise RuntimeError("the pagedllm CPU kernels are unavailable (see the warning above), and GGUF weights "
                           "kept packed need them; pass --quantization none to dequantize the model at load")
    return ops


# From this many rows on (prefill, large decode batches) a float32 product is faster: blocks of weight rows
# are dequantized into a reused buffer and multiplied by oneDNN (compute-bound there, where the integer
# kernel's per-block scaling costs more than the dequantization; docs/benchmarks.md).
DENSE_MIN_ROWS = 16
_DENSE_BLOCK_ELEMS = 1 << 21  # 8 MiB of float32 weights per block
_workspace = threading.local()


# Tiled layouts (kernels/csrc/gguf_ops.cpp, gguf_tile): the same bytes regrouped by 16 output rows, type id
# TILED_BASE + the GGML type; what the AVX-512 VNNI kernels read fastest at every row count.
TILED_BASE = 2000
_TILEABLE = (2, 3, 6, 7, 8, 12, 13, 14, I8_ROW)  # Q4_0 ... Q6_K, and I8_ROW


# The AVX2 row layout (gguf_a2pack): each row's own bytes regrouped for shuffle-free int16 products, type id
# A2_BASE + the GGML type; what the AVX2 kernels read fastest (machines without AVX-512 VNNI).
A2_BASE = 3000
_A2_ABLE = (2, 3, 8, 12, 14)  # Q4_0, Q4_1, Q8_0, Q4_K, Q6_K


def is_tiled(qtype: int) -> bool:
    # (membership, as the C++ is_tiled: the tiled I8_ROW id, TILED_BASE + 1000, is A2_BASE itself)
    return qtype - TILED_BASE in _TILEABLE


def is_a2(qtype: int) -> bool:
    return qtype - A2_BASE in _A2_ABLE


def base_type(qtype: int) -> int:
    """The GGML type (or I8_ROW) whose values a (possibly regrouped) type id holds."""
    return qtype - A2_BASE if is_a2(qtype) else qtype - TILED_BASE if is_tiled(qtype) else qtype


def logical_rows(tensor: torch.Tensor, qtype: int) -> int:
    return tensor.shape[0] * 16 if is_tiled(qtype) else tensor.shape[0]


def tile_packed(tensor: torch.Tensor, qtype: int) -> tuple[torch.Tensor, int]:
    """(tensor, qtype) in the layout this machine's kernels read fastest where they have one for it (AVX-512
    VNNI: the 16-row tiles; AVX2: the row layout), else unchanged."""
    if not envs.PAGEDLLM_GGUF_TILED:
        return tensor, qtype
    best = required_ops().gguf_best_impl()
    if best == 1 and qtype in _A2_ABLE:
        return required_ops().gguf_a2pack(tensor.contiguous(), qtype), A2_BASE + qtype
    if (best < 2 or qtype not in _TILEABLE or tensor.shape[0] % 16
            or (qtype == I8_ROW and (tensor.shape[1] - 4) % 32)):
        return tensor, qtype
    return required_ops().gguf_tile(tensor.contiguous(), qtype), TILED_BASE + qtype


Q5_0, Q8_0 = 6, 8


def widen_packed(tensor: torch.Tensor, qtype: int) -> tuple[torch.Tensor, int]:
    """(tensor, qtype) of a linear layer's packed rows in the format this machine multiplies fastest: on AVX2
    machines without AVX-512 VNNI (the row kernels) Q5_0 becomes Q8_0, the same values (gguf_q5_0_to_q8_0);
    else unchanged. The VNNI machines' tiles decode Q5_0 as cheaply as Q8_0."""
    if qtype != Q5_0 or not envs.PAGEDLLM_GGUF_WIDEN_Q5_0 or required_ops().gguf_best_impl() != 1:
        return tensor, qtype
    return required_ops().gguf_q5_0_to_q8_0(tensor.contiguous()), Q8_0


def _dense_buffer(numel: int) -> torch.Tensor:
    buf = getattr(_workspace, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _workspace.buf = torch.empty(numel, dtype=torch.float32)
    return buf


def _dense_matmul(x2: torch.Tensor, parts: Sequence[torch.Tensor], types: Sequence[int],
                  bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    k = x2.shape[1]
    x2 = x2.contiguous()
    block_rows = max(1, _DENSE_BLOCK_ELEMS // k)
    buf = _dense_buffer(min(block_rows, max(p.shape[0] for p in parts)) * k)
    ops, col = required_ops(), 0
    for part, qtype in zip(parts, types):
        for r0 in range(0, part.shape[0], block_rows):
            rows = min(block_rows, part.shape[0] - r0)
            w = buf[:rows * k].view(rows, k)
            ops.gguf_dequantize_rows(w, part[r0:r0 + rows], qtype, None)
            b = None if bias is None else bias[col:col + rows]
            out[:, col:col + rows] = torch.ops.mkldnn._linear_pointwise(x2, w, b, "none", [], "")
            col += rows


def gguf_matmul(x: torch.Tensor, parts: Sequence[torch.Tensor], types: Sequence[int],
                bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """x [..., K] @ (the parts' rows side by side)^T (+ bias), in x's dtype (computed in float32)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], out_features, dtype=torch.float32)
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    if x2.shape[0] >= DENSE_MIN_ROWS and x2.dtype == torch.float32 and _HAVE_ONEDNN and not any(
            is_tiled(t) for t in types):
        _dense_matmul(x2, parts, types, bias, out)
    else:
        required_ops().gguf_linear(out, x2, list(parts), list(types), bias, 0)
    out = out.reshape(*lead, out_features)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def gguf_embedding(ids: torch.Tensor, weight: torch.Tensor, qtype: int, dim: int, dtype: torch.dtype
                   ) -> torch.Tensor:
    out = torch.empty(ids.numel(), dim, dtype=torch.float32)
    required_ops().gguf_dequantize_rows(out, weight, qtype, ids.reshape(-1).to(torch.int64).contiguous())
    out = out.reshape(*ids.shape, dim)
    return out if dtype == torch.float32 else out.to(dtype)
