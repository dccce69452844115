"""Split-K tensor-core GEMM for decode-sized batches (tens to a few hundred rows): out = x @ weight.T.

At 64-256 rows a small model's projections (N and K of 1-6k) make only a few dozen output tiles, so a GEMM
that gives each tile to one thread block leaves most of the GPU's SMs idle while each busy block walks the
whole K loop; cuBLAS picks such kernels for Qwen3-0.6B's shapes and takes 6-8 us per projection where the
tensor cores need 1.5-4. Here each output tile's K range is cut into SPLIT_K slices, one block each, so the grid
covers the SMs. Every block writes its fp32 partial tile to a workspace and counts itself in per tile; the last
block of a tile to arrive (an acquire-release atomic orders the partials before it) sums them, applies the
epilogue (bias, SiLU-and-mul for a merged gate/up weight) and resets the counter, so a launch needs no separate
reduce kernel and stays CUDA-graph replayable.

The workspace and counters are allocated once per device (`_Workspace`); launches that would need more
workspace than it holds fall back to fewer splits.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel


@triton.jit
def _splitk_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr,
    M, stride_xm, stride_wn, stride_om,
    N: tl.constexpr, K_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr = False,
):
    """Grid (output tiles, SPLIT_K). GATED: weight rows [0, N) are the gate, [N, 2N) the up projection and the
    output is silu(x @ gate.T) * (x @ up.T), each product rounded to the output dtype as the unfused path does."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    n_tiles: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    rm = (tile // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tile % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = split * K_SPLIT + tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PREFETCH:
        # Pull this block's weight rows into L2 while the previous kernel still runs (weights never depend on it).
        row_start = w_ptr + rn * stride_wn + split * K_SPLIT
        _prefetch_l2(row_start, n_ok, K_SPLIT * 2)
        if GATED:
            _prefetch_l2(row_start + N * stride_wn, n_ok, K_SPLIT * 2)
    wait_prior_kernel(USE_PDL)
    for k in range(0, K_SPLIT, BLOCK_K):
        x = tl.load(x_ptrs + k, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs + k, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn + k, mask=n_ok[:, None], other=0.0)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up)

    if SPLIT_K == 1:
        _epilogue(acc, acc_up, bias_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_om, N, GATED, HAS_BIAS)
    else:
        NACC: tl.constexpr = 2 if GATED else 1
        TILE: tl.constexpr = BLOCK_M * BLOCK_N
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_ws = ws_ptr + tile.to(tl.int64) * (SPLIT_K * NACC * TILE)
        tl.store(tile_ws + split * (NACC * TILE) + offs, acc)
        if GATED:
            tl.store(tile_ws + split * (NACC * TILE) + TILE + offs, acc_up)
        # Release our partial, acquire everyone else's: the block that arrives last sees every partial.
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            total_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(tile_ws + s * (NACC * TILE) + offs, cache_modifier=".cg")
                if GATED:
                    total_up += tl.load(tile_ws + s * (NACC * TILE) + TILE + offs, cache_modifier=".cg")
            _epilogue(total, total_up, bias_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_om, N, GATED, HAS_BIAS)
            tl.store(count_ptr + tile, 0)  # ready for the next launch (and graph replay)


@triton.jit
def _prefetch_l2(ptrs, mask, NBYTES: tl.constexpr):
    """One bulk L2 prefetch of NBYTES (a multiple of 16, 16-byte aligned) from each pointer where mask holds."""
    size = tl.where(mask, NBYTES, 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _epilogue(acc, acc_up, bias_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_om,
              N: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        acc = act * acc_up.to(out_ty).to(tl.float32)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ty),
             mask=m_ok[:, None] & n_ok[None, :])


WORKSPACE_BYTES = 32 << 20
MAX_TILES = 8192


class _Workspace:
    """Partial tiles and per-tile arrival counters of one device (counters start at zero and every launch leaves
    them at zero)."""

    _by_device: dict[int, "_Workspace"] = {}

    def __init__(self, device: torch.device):
        self.partials = torch.empty(WORKSPACE_BYTES // 4, dtype=torch.float32, device=device)
        self.counters = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)

    @classmethod
    def get(cls, device: torch.device) -> "_Workspace":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in cls._by_device:
            cls._by_device[index] = cls(torch.device("cuda", index))
        return cls._by_device[index]


@functools.lru_cache(maxsize=None)
def _bulk_prefetch_ok(device: torch.device) -> bool:
    """cp.async.bulk.prefetch needs compute capability 9.0 (Hopper) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def splitk_config(m: int, n: int, k: int, gated: bool, num_sms: int = 132) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for `splitk_gemm`."""
    block_m = 64 if m <= 64 else 128
    block_n = 64
    block_k = 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while (tiles * split * 2 <= num_sms and k % (block_k * split * 2) == 0 and k // (split * 2) >= 256):
        split *= 2
    return block_m, block_n, block_k, split, 4, 4


def splitk_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, gated: bool = False,
                config: Optional[tuple[int, int, int, int, int, int]] = None,
                out: Optional[torch.Tensor] = None, prefetch: bool = True) -> torch.Tensor:
    """x [M, K] @ weight[N_total, K].T (+ bias); gated: silu(first half) * second half, N = N_total / 2."""
    m, k = x.shape
    n_total, k_w = weight.shape
    assert k == k_w, (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.stride(1) == 1, "splitk_gemm needs row-major x and weight"
    n = n_total // 2 if gated else n_total
    assert not gated or n_total % 2 == 0, weight.shape
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if bias is not None:
        assert bias.shape == (n_total,) and bias.stride(0) == 1, bias.shape
    block_m, block_n, block_k, split, num_warps, num_stages = config or splitk_config(m, n, k, gated)
    assert k % (block_k * split) == 0, (k, block_k, split)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    ws = _Workspace.get(x.device)
    nacc = 2 if gated else 1
    while split > 1 and (tiles * split * nacc * block_m * block_n > ws.partials.numel() or tiles > MAX_TILES):
        split //= 2
    _splitk_gemm_kernel[(tiles, split)](
        x, weight, bias if bias is not None else weight, out, ws.partials, ws.counters,
        m, x.stride(0), weight.stride(0), out.stride(0),
        N=n, K_SPLIT=k // split, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GATED=gated, HAS_BIAS=bias is not None, PREFETCH=prefetch and _bulk_prefetch_ok(x.device),
        num_warps=num_warps, num_stages=num_stages, **pdl_launch_args(x.device))
    return out
