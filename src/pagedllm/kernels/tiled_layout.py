"""The tiled layout of 4/8-bit weights that `kernels/qgemv.py` and `kernels/qgemm.py` read, and its torch
reference. `quantization/tiled.py` converts layers into it at load.

The internal layout (`quantization/packed.py`) packs `pack = 32 // bits` neighbouring input channels into one int32,
so a kernel that unpacks value i of every word gets the channels k = 8r + i: a stride-8 gather of the activations
for each of the eight values. The tiled layout reorders K inside tiles of TILE_WORDS (16) word rows so that value i
of the 16 words of a tile holds 16 *consecutive* channels:

    qweight int32 [K / pack, N]    word row t * 16 + r, value i (bits [i*bits, +bits)) = channel
                                   k' = t * 16 * pack + i * 16 + r   (one tile = 16 * pack channels: 128 at 4 bits)
    scales, zeros [G, N]           unchanged; the group of channel k' is k' // group_size
    perm int32 [K] or absent       act-order (GPTQ desc_act): channel k' of the layout is input channel perm[k'];
                                   the channels are sorted by group at load, so every group is contiguous

So a kernel reads, per value plane, one contiguous run of 16 activations and one scale/zero row (group sizes are
>= 16), and unpacks with one mask per plane. Plain torch (no Triton): the CPU references use it too.
"""
from __future__ import annotations

from typing import Optional

import torch

TILE_WORDS = 16


def tile_k(bits: int) -> int:
    """Input channels per tile: 16 words of 32 // bits values."""
    return TILE_WORDS * (32 // bits)


def unpack_kn(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K / pack, N] -> uint8 [K / pack, pack, N]: value i of each word (no reordering)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device).view(1, -1, 1)
    return ((qweight.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


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
