"""The CUDA kernels' layouts of 4/8-bit weights ("mma" for 4-bit weights the tensor-core GEMV holds, else "tiled"),
made once at load time from the internal layout.

The layout itself (what the kernels read, and its torch reference `dequantize_tiled`) is defined in
`kernels/tiled_layout.py`; this module decides which layers it applies to and converts them. Where the layout does
not apply (K not a multiple of a tile, groups that are neither a multiple nor a divisor of a tile, act-order groups
of unequal sizes, fractional zero points) the layer keeps the internal layout and the general kernel
(`kernels/dequant_gemm.py`).
"""
from __future__ import annotations

from typing import Optional

import logging

import torch
from torch import nn

from pagedllm import envs
from pagedllm.kernels.tiled_layout import TILE_WORDS, tile_k, unpack_kn

logger = logging.getLogger(__name__)


def tiled_layout_problem(k: int, n: int, bits: int, group_size: int, zeros: torch.Tensor,
                         g_idx: Optional[torch.Tensor]) -> Optional[str]:
    """Why the tiled layout cannot hold this weight (None: it can)."""
    tk = tile_k(bits)
    if k % tk:
        return f"{k} input channels is not a multiple of {tk}"
    if group_size % tk and tk % group_size:
        return f"group_size {group_size} is neither a multiple nor a divisor of {tk}"
    if group_size % 16:
        return f"group_size {group_size} is not a multiple of 16"
    if not torch.equal(zeros, zeros.round()):
        return "fractional zero points"
    if g_idx is not None and _act_order_perm(g_idx, group_size, zeros.shape[0]) is None:
        return "act-order groups of unequal sizes"
    return None


def _act_order_perm(g_idx: torch.Tensor, group_size: int, groups: int) -> Optional[torch.Tensor]:
    """The stable sort of the channels by group, if it makes every group a contiguous run of group_size."""
    g = g_idx.long()
    perm = torch.sort(g, stable=True).indices
    expected = torch.arange(g.numel(), device=g.device) // group_size
    if int(g.max()) >= groups or not torch.equal(g[perm], expected):
        return None
    return perm


def pack_kn(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [K / pack, pack, N] -> int32 [K / pack, N] (value i into bits [i*bits, +bits))."""
    word = torch.zeros(values.shape[0], values.shape[2], dtype=torch.int32, device=values.device)
    for i in range(values.shape[1]):
        word |= values[:, i].to(torch.int32) << (i * bits)
    return word


def to_tiled(qweight: torch.Tensor, bits: int, group_size: int, zeros: torch.Tensor,
             g_idx: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Internal layout -> (tiled qweight, perm or None). Check `tiled_layout_problem` first."""
    pack = 32 // bits
    kp, n = qweight.shape
    k = kp * pack
    q = unpack_kn(qweight, bits).reshape(k, n)  # [K, N], channel order
    perm = None
    if g_idx is not None:
        perm = _act_order_perm(g_idx, group_size, zeros.shape[0])
        assert perm is not None, "act-order groups of unequal sizes"
        q = q.index_select(0, perm)
        perm = perm.to(torch.int32).contiguous()
    tiles = k // tile_k(bits)
    # channel t*16*pack + i*16 + r -> word row t*16 + r, value i
    q = q.view(tiles, pack, TILE_WORDS, n).transpose(1, 2).reshape(kp, pack, n)
    return pack_kn(q, bits).contiguous(), perm


def _layout_q(layer: nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The layer's q values [K, N] in layout-channel order (act-order: channels sorted by group) and the perm."""
    bits = layer.quant_bits
    kp, n = layer.qweight.shape
    q = unpack_kn(layer.qweight.data, bits).reshape(kp * (32 // bits), n)
    if layer.g_idx is None:
        return q, None
    perm = _act_order_perm(layer.g_idx.data, layer.quant_group_size, layer.zeros.shape[0])
    return q.index_select(0, perm), perm.to(torch.int32).contiguous()


def mma_layout_unsupported(layer: nn.Module) -> Optional[str]:
    """Why a loaded 4-bit layer cannot take the mma layout (None: it can)."""
    from pagedllm.kernels.qgemv_mma import mma_layout_problem

    bits, group = layer.quant_bits, layer.quant_group_size
    kp, n = layer.qweight.shape
    k = kp * (32 // bits)
    problem = mma_layout_problem(k, n, bits, group) or tiled_layout_problem(k, n, bits, group, layer.zeros.data,
                                                                          layer.g_idx)
    if problem is None and layer.scales.dtype not in (torch.float16, torch.bfloat16):
        problem = f"{layer.scales.dtype} scales (the kernel reads fp16 / bf16)"
    if problem is None and layer.qweight.is_cuda:
        from pagedllm.kernels.qgemv_mma import kernel_available

        problem = kernel_available(layer.qweight.device)
    return problem


def use_mma_layout(layer: nn.Module) -> bool:
    """Convert a loaded layer (internal layout) to the tensor-core GEMV's layout (`kernels/qgemv_mma.py`) in place,
    where it applies; sets layer.quant_layout = "mma" and quant_perm. Returns whether it did."""
    problem = mma_layout_unsupported(layer)
    if not envs.PAGEDLLM_QUANT_TILED or problem is not None:  # =0: every layer keeps the internal layout (the A/B)
        logger.debug("%s: no mma layout: %s", getattr(layer, "prefix", "layer"), problem)
        return False
    from pagedllm.kernels.qgemv_mma import prepare, to_mma_layout

    q, perm = _layout_q(layer)
    words = to_mma_layout(q.t())
    try:
        prepare(words, layer.scales.dtype, layer.quant_group_size, perm is not None,
                getattr(layer, "bias", None) is not None)
    except Exception as e:  # e.g. no NVRTC library beside this torch: the tiled kernels take the layer
        logger.warning("%s: the tensor-core int4 GEMV did not compile (%s); using the tiled kernels",
                       getattr(layer, "prefix", "layer"), e)
        return False
    layer.qweight = nn.Parameter(words, requires_grad=False)
    if layer.g_idx is not None:
        del layer.g_idx
        layer.g_idx = None
    layer.register_buffer("quant_perm", perm, persistent=False)
    layer.quant_layout = "mma"
    return True


def use_tiled_layout(layer: nn.Module) -> bool:
    """Convert a loaded layer (internal layout: qweight, scales, zeros, g_idx) to the tiled layout in place, where
    it applies and PAGEDLLM_QUANT_TILED is on; sets layer.quant_layout = "tiled", quant_perm, quant_counters and
    quant_gemv_max_rows. Returns whether it did."""
    bits, group = layer.quant_bits, layer.quant_group_size
    kp, n = layer.qweight.shape
    problem = tiled_layout_problem(kp * (32 // bits), n, bits, group, layer.zeros.data, layer.g_idx)
    if not envs.PAGEDLLM_QUANT_TILED or problem is not None:
        if problem is not None:
            logger.debug("%s keeps the general dequant kernel: %s", getattr(layer, "prefix", "layer"), problem)
        return False
    from pagedllm.kernels.qgemv import QGEMV_MAX_ROWS, counters_for

    qweight, perm = to_tiled(layer.qweight.data, bits, group, layer.zeros.data,
                             None if layer.g_idx is None else layer.g_idx.data)
    layer.qweight = nn.Parameter(qweight, requires_grad=False)
    if layer.g_idx is not None:
        del layer.g_idx
        layer.g_idx = None
    layer.register_buffer("quant_perm", perm, persistent=False)
    # Split-K arrival counters (zero between launches; each launch's last program resets its own).
    layer.register_buffer("quant_counters", counters_for(n, qweight.device), persistent=False)
    layer.quant_gemv_max_rows = max(0, min(QGEMV_MAX_ROWS, envs.PAGEDLLM_QUANT_GEMV_MAX_ROWS))
    layer.quant_layout = "tiled"
    return True
