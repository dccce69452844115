"""4/8-bit weight-only matmul (Triton): `x @ dequant(W)^T + b` straight from the packed weights.

The weight layout is quantization/packed.py's: qweight int32 [K / pack, N] (pack = 32 // bits values along K, value
i of a word in bits [i*bits, +bits)), scales and zeros [G, N] (w = (q - zero) * scale), optional g_idx [K] (the
group of each input channel; else k // group_size). Each program dequantizes [BLOCK_K, BLOCK_N] tiles in registers
and never writes a dense weight:
- few rows (decode, M <= 8): products summed on the CUDA cores, the K loop split over programs (SPLIT_K) so the
  weight stream covers every SM; partial sums [SPLIT_K, M, N] in fp32 are added by one torch sum;
- more rows: `tl.dot` on the tensor cores over the dequantized tile (activation dtype).
`dequant_matmul_ref` is the torch reference.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 8


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, k0, offs_n, N, K, group_size,
                  BITS: tl.constexpr, HAS_GIDX: tl.constexpr, GROUP_ALIGNED: tl.constexpr, BLOCK_K: tl.constexpr):
    """The dense [BLOCK_K, BLOCK_N] fp32 weight tile of W^T for k in [k0, k0 + BLOCK_K): each packed word is loaded
    once and split into its PACK values; with GROUP_ALIGNED (the tile inside one group) one scale/zero row."""
    PACK: tl.constexpr = 32 // BITS
    n_ok = offs_n < N
    rows = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    words = tl.load(qw_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :],
                    mask=(rows < K // PACK)[:, None] & n_ok[None, :], other=0)  # [BLOCK_K / PACK, BLOCK_N]
    shifts = tl.arange(0, PACK) * BITS
    q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [BLOCK_K / PACK, PACK, BLOCK_N]
    q = tl.reshape(q, (BLOCK_K, q.shape[2])).to(tl.float32)  # row r*PACK + i = value i of word r
    if GROUP_ALIGNED:
        g = k0 // group_size
        g_ok = n_ok & (k0 < K)  # a split's last tiles may lie past K
        s = tl.load(s_ptr + g.to(tl.int64) * N + offs_n, mask=g_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g.to(tl.int64) * N + offs_n, mask=g_ok, other=0.0).to(tl.float32)
        return (q - z[None, :]) * s[None, :]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    if HAS_GIDX:
        g = tl.load(g_ptr + offs_k, mask=k_ok, other=0)
    else:
        g = offs_k // group_size
    mask = k_ok[:, None] & n_ok[None, :]
    gn = g[:, None].to(tl.int64) * N + offs_n[None, :]
    s = tl.load(s_ptr + gn, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + gn, mask=mask, other=0.0).to(tl.float32)
    return (q - z) * s


@triton.jit
def _dequant_matmul_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, stride_xm, stride_om, group_size,
    BITS: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, K_PER_SPLIT: tl.constexpr, GROUP_ALIGNED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for i in range(0, K_PER_SPLIT, BLOCK_K):  # constexpr trip count: one variant per layer shape
        offs_k = k_start + i + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, k_start + i, offs_n, N, K, group_size, BITS, HAS_GIDX,
                          GROUP_ALIGNED, BLOCK_K)
        if USE_DOT:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
        else:
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    mask = m_ok[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :], acc, mask=mask)


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def launch_config(m: int, n: int, k: int, num_sms: int, group_size: int = 0) -> dict:
    """Tile sizes and the K split for an [m, k] x [k, n] product (see the module docstring). A K tile stays
    inside one group where it can (one scale/zero row per tile)."""
    if m <= GEMV_MAX_ROWS:
        block_m = triton.next_power_of_2(m)
        block_n = 64
        block_k = max(32, min(256, 16384 // (block_m * block_n)))
        use_dot = False
    else:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
        block_n = 64 if m <= 64 else 128
        block_k = 64
        use_dot = True
    if 32 <= group_size < block_k and group_size & (group_size - 1) == 0:
        block_k = group_size
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = 1
    while programs * split_k < 2 * num_sms and k // (2 * split_k) >= 4 * block_k:
        split_k *= 2
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot, SPLIT_K=split_k,
                k_per_split=k_per_split)


def dequant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                   group_size: int, g_idx: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                   num_sms: Optional[int] = None) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) -> [..., N] in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*shape[:-1], n)
    cfg = launch_config(m, n, k, num_sms or (_num_sms(x.device) if x.is_cuda else 8), group_size)
    split_k = cfg["SPLIT_K"]
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split_k)
    _dequant_matmul_kernel[grid](
        x2, qweight, scales, zeros, g_idx if g_idx is not None else qweight, bias if bias is not None else scales,
        out, part, m, n, k, x2.stride(0), out.stride(0), group_size,
        BITS=bits, HAS_GIDX=g_idx is not None, HAS_BIAS=bias is not None and split_k == 1, USE_DOT=cfg["USE_DOT"],
        SPLIT_K=split_k, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", K_PER_SPLIT=cfg["k_per_split"],
        GROUP_ALIGNED=g_idx is None and group_size % cfg["BLOCK_K"] == 0 and cfg["k_per_split"] % cfg["BLOCK_K"] == 0,
        num_warps=4)
    if split_k > 1:
        summed = part.sum(0)
        if bias is not None:
            summed += bias.float()
        out.copy_(summed)
    return out.reshape(*shape[:-1], n)


def dequant_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                       group_size: int, g_idx: Optional[torch.Tensor] = None,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same product in fp32 torch (dense dequantized weight), rounded once to x's dtype."""
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    q = ((qweight.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)).reshape(-1, qweight.shape[1])
    g = (g_idx.long() if g_idx is not None else torch.arange(q.shape[0], device=q.device) // group_size)
    w = (q.float() - zeros.float()[g]) * scales.float()[g]  # [K, N]
    out = x.float() @ w
    if bias is not None:
        out += bias.float()
    assert q.shape[0] == pack * qweight.shape[0]
    return out.to(x.dtype)
