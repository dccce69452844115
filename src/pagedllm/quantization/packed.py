"""The internal layout of the integer weight-only methods (GPTQ, AWQ, compressed-tensors W4A16/W8A16): packing,
unpacking, the dense reference, and the checks of what it holds.

Each method loads its checkpoint's own layout, then converts it once (`packed_method.PackedIntLinearMethod`) to
ONE internal layout that the torch reference (CPU) and the Triton kernels (CUDA) both read:

    qweight  int32 [K / pack, N]   pack = 32 // bits values along K per int32, value i in bits [i*bits, +bits)
    scales   [G, N]                the activation dtype
    zeros    [G, N]                the same dtype: w = (q - zero) * scale  (symmetric: zero = 2**(bits-1))
    g_idx    int32 [K] or absent   group of each input channel (act-order); absent: k // group_size

K = in features on this rank, N = out features on this rank, G = groups.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

import torch

SUPPORTED_BITS = (4, 8)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Optional[Sequence[int]] = None
                 ) -> torch.Tensor:
    """int32 packed `32 // bits` unsigned values per element along `dim` -> int32 values, `dim` grown by the
    pack factor. `order[i]` is the logical position held in bits [i*bits, +bits) (AWQ: 0 2 4 6 1 3 5 7)."""
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    moved = packed.movedim(dim, -1)
    vals = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., M, pack], position i -> order[i]
    if order is not None:
        inverse = torch.argsort(torch.tensor(order, device=packed.device))
        vals = vals[..., inverse]
    return vals.reshape(*moved.shape[:-1], moved.shape[-1] * pack).movedim(-1, dim)


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The inverse of unpack_int32: unsigned `values` (< 2**bits) -> int32, `dim` shrunk by the pack factor."""
    pack = 32 // bits
    moved = values.to(torch.int64).movedim(dim, -1)
    if moved.shape[-1] % pack:
        raise ValueError(f"cannot pack {moved.shape[-1]} values {pack} per int32")
    grouped = moved.reshape(*moved.shape[:-1], moved.shape[-1] // pack, pack)
    if order is not None:
        grouped = grouped[..., list(order)]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    word = (grouped << shifts).sum(-1)  # fits in 32 unsigned bits
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32).movedim(-1, dim)


def dequantize_packed_kn(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                         group_size: int, g_idx: Optional[torch.Tensor] = None,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The internal layout -> the dense weight, transposed: [K, N] (what x @ W^T multiplies by), contiguous.
    Written for the CPU path: one contiguous unpack, then in-place zero/scale per group by broadcasting."""
    pack = 32 // bits
    kp, n = qweight.shape
    if bits == 8 and sys.byteorder == "little":  # the 4 values of a word are its bytes, lowest first
        q = qweight.contiguous().view(torch.uint8).view(kp, n, 4).transpose(1, 2).reshape(kp * 4, n).to(dtype)
    else:
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device).view(1, pack, 1)
        q = ((qweight.reshape(kp, 1, n) >> shifts) & ((1 << bits) - 1)).reshape(kp * pack, n).to(dtype)  # [K, N]
    if g_idx is None and q.shape[0] == scales.shape[0] * group_size:
        grouped = q.view(scales.shape[0], group_size, n)
        grouped.sub_(zeros.to(dtype)[:, None, :]).mul_(scales.to(dtype)[:, None, :])
        return q
    g = (g_idx.long() if g_idx is not None else torch.arange(q.shape[0], device=q.device) // group_size)
    return q.sub_(zeros.to(dtype)[g]).mul_(scales.to(dtype)[g])


def dequantize_packed(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                      group_size: int, g_idx: Optional[torch.Tensor] = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The internal layout -> the dense [N, K] weight (the torch reference every kernel is checked against)."""
    return dequantize_packed_kn(qweight, scales, zeros, bits, group_size, g_idx, dtype).t()


def check_bits(method: str, bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{method} with bits={bits} is not supported; pagedllm loads 4- and 8-bit {method} "
                         f"checkpoints.")


def check_group_size(method: str, group_size: int) -> None:
    if group_size != -1 and (group_size < 16 or group_size & (group_size - 1)):
        raise ValueError(f"{method} with group_size={group_size} is not supported; use -1 or a power of two >= 16.")
