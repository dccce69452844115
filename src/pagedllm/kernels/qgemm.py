"""Weight-only matmul over 4/8-bit weights in the tiled layout (`quantization/tiled.py`) on the tensor cores: the
path for more rows than the CUDA-core GEMV (`kernels/qgemv.py`) is fast at.

Each program owns a [BLOCK_M, BLOCK_N] output tile and a range of K tiles (split-K while the grid is too small
to cover the SMs, finished in-kernel as in qgemv). Per K tile it loads [16, BLOCK_N] int32 words (the next tile's
words are in flight while it computes the current one), unpacks all value planes at once into a
[planes, 16, BLOCK_N] tensor with the 2**23 mantissa trick (no int -> float conversions), applies each plane's
group scale / zero (one row per plane: group sizes are >= 16), and the [16 * planes, BLOCK_N] tile - in K order,
which is what the tiled layout buys - goes to `tl.dot` with the activation tile [BLOCK_M, 16 * planes] (one
contiguous load; act-order gathers it through `perm`). Accumulation is fp32.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel
from pagedllm.kernels.qgemv import MAGIC, num_sms, split_for, split_k_store


# Row and tile counts are not specialized on (one compiled variant serves every batch size of a launch config;
# the tile loop's trip count stays a constant: the interpreter cannot loop over a scalar argument).
@triton.jit(do_not_specialize=["M", "NUM_TILES"])
def _qgemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, stride_xm, stride_om, NUM_TILES,
    BITS: tl.constexpr, GROUP: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = 16 * PACK
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)  # fastest: the programs sharing a weight tile run together (L2 reuse)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rows < M
    n_ok = cols < N
    r = tl.arange(0, 16)
    planes = tl.arange(0, PACK)
    shifts = (planes * BITS)[:, None, None]
    kk = tl.arange(0, TILE_K)
    first = pid_k * TILES_PER_SPLIT
    w_ptrs = qw_ptr + (first * 16 + r)[:, None].to(tl.int64) * N + cols[None, :]
    w = tl.load(w_ptrs, mask=n_ok[None, :] & (first < NUM_TILES), other=0, eviction_policy="evict_first")
    wait_prior_kernel(USE_PDL)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(TILES_PER_SPLIT):
        tile = first + t
        t_ok = tile < NUM_TILES
        w_next = tl.load(w_ptrs + (t + 1) * 16 * N, mask=n_ok[None, :] & (tile + 1 < NUM_TILES) &
                         (t + 1 < TILES_PER_SPLIT), other=0, eviction_policy="evict_first")
        k0 = tile * TILE_K
        g_off = ((k0 + 16 * planes) // GROUP).to(tl.int64)[:, None] * N + cols[None, :]  # [PACK, BLOCK_N]
        sz_mask = (planes >= 0)[:, None] & n_ok[None, :] & t_ok
        s = tl.load(s_ptr + g_off, mask=sz_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off, mask=sz_mask, other=0.0).to(tl.float32)
        q = (((w[None, :, :] >> shifts) & MASK) | MAGIC).to(tl.float32, bitcast=True)  # 2**23 + q
        dq = (q - (z + 8388608.0)[:, None, :]) * s[:, None, :]  # [PACK, 16, BLOCK_N]
        dq = tl.reshape(dq, (TILE_K, BLOCK_N)).to(x_ptr.dtype.element_ty)  # row j * 16 + r = channel k0 + row
        k_idx = k0 + kk
        if HAS_PERM:
            k_idx = tl.load(perm_ptr + k_idx, mask=t_ok, other=0)
        xt = tl.load(x_rows + k_idx[None, :], mask=m_ok[:, None] & t_ok, other=0.0)
        acc = tl.dot(xt, dq, acc, input_precision=DOT_PRECISION)
        w = w_next
    n_blocks = tl.num_programs(1)
    split_k_store(acc, rows, cols, m_ok, n_ok, part_ptr, cnt_ptr, bias_ptr, out_ptr, M, N, stride_om,
                  pid_m * n_blocks + pid_n, pid_k, SPLIT_K, HAS_BIAS)


def gemm_config(m: int) -> dict:
    """Tile sizes by row count (benchmarks/quant.py --sweep times alternatives)."""
    if m <= 16:
        return {"block_m": 16, "block_n": 64, "num_warps": 4, "programs_per_sm": 2}
    if m <= 32:
        return {"block_m": 32, "block_n": 64, "num_warps": 4, "programs_per_sm": 2}
    if m <= 64:
        return {"block_m": 64, "block_n": 64, "num_warps": 4, "programs_per_sm": 2}
    return {"block_m": 128, "block_n": 128, "num_warps": 8, "programs_per_sm": 1}


def quant_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               group_size: int, perm: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               counters: torch.Tensor, config: Optional[dict] = None) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ dequant(W)^T (+ bias) -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    assert x.stride(1) == 1 and qweight.shape[0] * (32 // bits) == k
    cfg = config or gemm_config(m)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    num_tiles = k // (16 * (32 // bits))
    m_blocks, n_blocks = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    split = 1
    if m_blocks * n_blocks <= counters.numel():  # one counter per output tile
        split = cfg.get("split_k") or split_for(m_blocks * n_blocks, num_tiles, num_sms(x.device),
                                                cfg["programs_per_sm"], cfg.get("max_split", 16))
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _qgemm_kernel[(m_blocks, n_blocks, split)](
        x, qweight, scales, zeros, perm if perm is not None else qweight, bias if bias is not None else scales,
        out, part, counters, m, n, x.stride(0), out.stride(0), num_tiles,
        BITS=bits, GROUP=group_size, TILES_PER_SPLIT=triton.cdiv(num_tiles, split),
        SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 2), **pdl_launch_args(x.device))
    return out
