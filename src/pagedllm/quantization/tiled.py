"""The CUDA kernels' layout of 4/8-bit weights ("tiled"), made once at load time from the internal layout.

The internal layout (`packed.py`) packs `pack = 32 // bits` neighbouring input channels into one int32, so a
kernel that unpacks value i of every word gets the channels k = 8r + i: a stride-8 gather of the activations for
each of the eight values. The tiled layout reorders K inside tiles of TILE_WORDS (16) word rows so that value i of
the 16 words of a tile holds 16 *consecutive* channels:

    qweight int32 [K / pack, N]    word row t * 16 + r, value i (bits [i*bits, +bits)) = channel
                                   k' = t * 16 * pack + i * 16 + r   (one tile = 16 * pack channels: 128 at 4 bits)
    scales, zeros [G, N]           unchanged; the group of channel k' is k' // group_size
    perm int32 [K] or absent       act-order (GPTQ desc_act): channel k' of the layout is input channel perm[k'];
                                   the channels are sorted by group at load, so every group is contiguous

So a kernel reads, per value plane, one contiguous run of 16 activations and one scale/zero row (group sizes are
>= 16), and unpacks with one mask per plane. Where the layout does not apply (K not a multiple of a tile, groups
that are neither a multiple nor a divisor of a tile, act-order groups of unequal sizes, fractional zero points) the
layer keeps the internal layout and the general kernel (`kernels/dequant_gemm.py`).
"""
from __future__ import annotations

from typing import Optional

import logging

import torch
from torch import nn

from pagedllm import envs

logger = logging.getLogger(__name__)

TILE_WORDS = 16


def tile_k(bits: int) -> int:
    """Input channels per tile: 16 words of 32 // bits values."""
    return TILE_WORDS * (32 // bits)


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


def unpack_kn(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K / pack, N] -> uint8 [K / pack, pack, N]: value i of each word (no reordering)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device).view(1, -1, 1)
    return ((qweight.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


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


def from_tiled(qweight: torch.Tensor, bits: int, perm: Optional[torch.Tensor]) -> torch.Tensor:
    """Tiled qweight -> the values in input-channel order, int32 [K, N] (references, dequantized_weight)."""
    pack = 32 // bits
    kp, n = qweight.shape
    tiles = kp // TILE_WORDS
    q = unpack_kn(qweight, bits).view(tiles, TILE_WORDS, pack, n).transpose(1, 2).reshape(kp * pack, n)
    if perm is not None:
        out = torch.empty_like(q)
        out[perm.long()] = q
        q = out
    return q.to(torch.int32)


def dequantize_tiled(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
                     perm: Optional[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [N, K] weight of a tiled layer (input-channel order)."""
    q = from_tiled(qweight, bits, perm).to(dtype)  # [K, N]
    k = q.shape[0]
    groups = torch.arange(k, device=q.device) // group_size  # group of each layout channel k'
    if perm is not None:
        g = torch.empty_like(groups)
        g[perm.long()] = groups
        groups = g
    return ((q - zeros.to(dtype)[groups]) * scales.to(dtype)[groups]).t()


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
