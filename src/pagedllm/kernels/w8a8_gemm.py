"""W8A8 (INT8 or FP8 E4M3) on CUDA in two kernels per linear layer (Triton): the activations quantized per token
(`kernels/quant_act`), then 8-bit x 8-bit on the tensor cores (int32 accumulation for int8, fp32 for FP8) with the
scales, the bias and the cast in the GEMM's epilogue.

The torch form (`quantization.kernels.int8_w8a8_linear` off CUDA) is a dozen kernels per layer (abs, amax, divide,
round, clamp, cast; torch._int_mm; two scale multiplies, the bias, the cast), each a launch and a pass over [M, K] or
[M, N] in fp32. The result here is the same: int32 sums are exact in any order, and the epilogue does the torch
form's fp32 operations in its order ((acc * x_scale) * w_scale, + bias, cast). FP8 products are exact in fp32 and
summed in the tensor cores' order, so FP8 results match torch._scaled_mm to rounding, not bit for bit; at few rows
this kernel replaces it (cuBLAS's FP8 GEMM is slower than bf16 there).

Few rows leave few output tiles, so the K loop is split between programs (SPLIT_K): each split stores its partial
(int32 or fp32), and the last split of a tile to arrive (a counter per tile, reset by it) adds them in split order
(deterministic) and runs the epilogue.

At one row a tensor-core tile is mostly padding and the product is a pass over the weight: a GEMV
(`_w8a8_gemv_kernel`, the layout of kernels/gemv.py) holds whole weight rows in registers, loads them before the
programmatic-dependent-launch wait (they overlap the activation quantization before it), and sums each row's
products on the CUDA cores: int8 in int32 (exact: the same results), four bytes per instruction (dp4a on int32
words, GEMV_WORDS), FP8 in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm import envs
from pagedllm.kernels.paged_attention import sm_count
from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel

# The GEMV takes up to this many rows (FP8, or int8 byte by byte: from two on, its sums on the CUDA cores cost
# more than the tiles' padding), or up to W8A8_GEMV_WORDS_MAX_ROWS for int8 on int32 words, four products per
# dp4a (ahead of the tiles up to four rows; docs/benchmarks.md). Each program holds GEMV_TILE_BYTES of weight rows
# (a K up to that many). GEMV_WORDS False keeps int8 byte by byte.
W8A8_GEMV_MAX_ROWS = 1
W8A8_GEMV_WORDS_MAX_ROWS = 4
GEMV_TILE_BYTES = 32768
GEMV_WORDS = True


@triton.jit
def _epilogue(acc, rows, cols, m_ok, n_ok, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr, stride_om,
              HAS_BIAS: tl.constexpr):
    xs = tl.load(a_scale_ptr + rows, mask=m_ok, other=0.0)
    ws = tl.load(b_scale_ptr + cols, mask=n_ok, other=0.0)
    out = acc.to(tl.float32) * xs[:, None]
    out = out * ws[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _w8a8_gemm_kernel(a_ptr, b_ptr, out_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, part_ptr, cnt_ptr,
                      M, N, K, stride_am, stride_bn, stride_om, K_PER_SPLIT,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, FLOAT: tl.constexpr,
                      USE_PDL: tl.constexpr):
    wait_prior_kernel(USE_PDL)  # (PDL: the launch overlaps the activation quantization before it)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles walk the column tiles together: their weight tiles are read from L2 once per group
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rows < M
    n_ok = cols < N
    rk = tl.arange(0, BLOCK_K)
    k0 = pid_k * K_PER_SPLIT
    # rows past M and columns past N read rows / columns wrapped around (their results are never stored): no masks
    # in the loop, and no address read by many rows of a tile (all reading row 0 made 72 rows twice as slow as 128)
    a_ptrs = a_ptr + (rows % M)[:, None].to(tl.int64) * stride_am + (k0 + rk)[None, :]
    b_ptrs = b_ptr + (cols % N)[None, :].to(tl.int64) * stride_bn + (k0 + rk)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32 if FLOAT else tl.int32)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        elif FLOAT:  # masked FP8 lanes filled with 0 bits (+0.0): Triton cannot cast a 0 constant to FP8
            k_ok = k0 + k + rk < K
            a = tl.load(a_ptrs.to(tl.pointer_type(tl.uint8)), mask=k_ok[None, :], other=0).to(
                a_ptr.dtype.element_ty, bitcast=True)
            b = tl.load(b_ptrs.to(tl.pointer_type(tl.uint8)), mask=k_ok[:, None], other=0).to(
                b_ptr.dtype.element_ty, bitcast=True)
        else:
            k_ok = k0 + k + rk < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0)
        if FLOAT:
            # Hopper's FP8 tensor cores sum in reduced precision: each 32-deep step goes to the fp32 accumulator
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=32)
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # (Triton 3.6 asks for it with an int32 accumulator)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SPLIT_K == 1:
        _epilogue(acc, rows, cols, m_ok, n_ok, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr, stride_om, HAS_BIAS)
    else:
        tile = pid_m * num_n + pid_n
        part = part_ptr + (tile * BLOCK_M * BLOCK_N).to(tl.int64) * SPLIT_K \
            + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part + pid_k * BLOCK_M * BLOCK_N, acc)
        # every warp's partial stored before the one thread's counting atomic publishes it (acq_rel)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32 if FLOAT else tl.int32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part + s * BLOCK_M * BLOCK_N, cache_modifier=".cg")
            _epilogue(total, rows, cols, m_ok, n_ok, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr, stride_om,
                      HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def _dp4a(a, b, USE_ASM: tl.constexpr):
    """Per int32 word: the sum of the products of its four signed bytes (PTX dp4a; off CUDA the same in shifts)."""
    if USE_ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros_like(a)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = ((a << 24) >> 24) * ((b << 24) >> 24) + ((a << 16) >> 24) * ((b << 16) >> 24)
        return s + ((a << 8) >> 24) * ((b << 8) >> 24) + (a >> 24) * (b >> 24)


@triton.jit
def _w8a8_gemv_kernel(a_ptr, b_ptr, out_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, M, stride_am, stride_bn, stride_om,
                      N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, K_PAD: tl.constexpr,
                      FLOAT: tl.constexpr, WORDS: tl.constexpr, USE_ASM: tl.constexpr, HAS_BIAS: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """WORDS (int8, K and the strides multiples of 4): weights and activations read as int32 words of four bytes,
    each word pair one dp4a (K_PAD, K and the strides are then in words); else byte by byte."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, K_PAD)
    n_ok = cols < N
    k_ok = rk < K
    # 8-bit values loaded as bytes (a masked FP8 load cannot be filled with a 0 constant), reinterpreted after
    unit = tl.int32 if WORDS else tl.uint8
    b_raw = tl.load(b_ptr.to(tl.pointer_type(unit)) + cols.to(tl.int64)[:, None] * stride_bn + rk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0, eviction_policy="evict_first")
    ws = tl.load(b_scale_ptr + cols, mask=n_ok, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)
    wait_prior_kernel(USE_PDL)
    a_row = a_ptr.to(tl.pointer_type(unit))
    for m in range(M):
        a_raw = tl.load(a_row + m * stride_am + rk, mask=k_ok, other=0)
        if WORDS:
            acc = tl.sum(_dp4a(b_raw, a_raw[None, :], USE_ASM), axis=1)
        elif FLOAT:
            a = a_raw.to(a_ptr.dtype.element_ty, bitcast=True)
            acc = tl.sum(b_raw.to(b_ptr.dtype.element_ty, bitcast=True).to(tl.float32) * a.to(tl.float32)[None, :],
                         axis=1)
        else:
            a = a_raw.to(a_ptr.dtype.element_ty, bitcast=True)
            acc = tl.sum(b_raw.to(b_ptr.dtype.element_ty, bitcast=True).to(tl.int32) * a.to(tl.int32)[None, :],
                         axis=1)
        out = acc.to(tl.float32) * tl.load(a_scale_ptr + m)
        out = out * ws
        if HAS_BIAS:
            out = out + bias
        tl.store(out_ptr + m * stride_om + cols, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def _words_fit(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the int8 GEMV can read a and b as int32 words (K, the row strides and the bases multiples of 4)."""
    k = a.shape[1]
    return (GEMV_WORDS and a.dtype == torch.int8 and k % 4 == 0 and a.stride(0) % 4 == 0 and b.stride(0) % 4 == 0
            and a.data_ptr() % 4 == 0 and b.data_ptr() % 4 == 0)


def _gemv(a, a_scale, b, b_scale, bias, out, block_n: Optional[int] = None, num_warps: int = 8,
          words: Optional[bool] = None) -> None:
    m, k = a.shape
    n = b.shape[0]
    k_pad = triton.next_power_of_2(k)
    block_n = block_n or max(1, min(triton.next_power_of_2(n), GEMV_TILE_BYTES // k_pad))
    if words is None:
        words = _words_fit(a, b)
    unit = 4 if words else 1
    _w8a8_gemv_kernel[(triton.cdiv(n, block_n),)](
        a, b, out, a_scale, b_scale, out if bias is None else bias, m, a.stride(0) // unit, b.stride(0) // unit,
        out.stride(0), N=n, K=k // unit, BLOCK_N=block_n, K_PAD=max(1, k_pad // unit), FLOAT=a.dtype != torch.int8,
        WORDS=words, USE_ASM=a.is_cuda and not envs.TRITON_INTERPRET, HAS_BIAS=bias is not None,
        num_warps=num_warps, **pdl_launch_args(a.device))


def counters_for(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed split-K counters for a layer of n output columns (one per output tile of a split launch)."""
    return torch.zeros(triton.cdiv(n, 32) + 1, dtype=torch.int32, device=device)


def launch_config(m: int, n: int, k: int, sms: int, fp8: bool = False) -> dict:
    """Tile sizes, warps, stages and the K split for an [m, k] x [k, n] product (from the H200 sweep of 8B layers,
    `benchmarks/quant.py --sweep int8`): one row of 16-64-row tiles for few rows, 128-column tiles where they
    still give every SM one, else 64 columns and a deeper K step. Above 64 rows (int8: `--sweep int8 --rows 256
    1024` and an A/B of the rules at 128-1024 rows) the largest of 128 x 128, 64 x 128 tiles that still gives every
    SM one, else 64-row tiles (a 256-deep K step for a long K); FP8 keeps 128 x 128 tiles for two per SM. The K
    split (one row of tiles only) while the programs fit one wave."""
    if m <= 64:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        if m > 32 and triton.cdiv(n, 128) >= sms:
            cfg = dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
        else:
            cfg = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4)
    elif fp8:  # (the fp32 promotion every 32-deep step: larger tiles lose)
        if triton.cdiv(m, 128) * triton.cdiv(n, 128) >= 2 * sms:
            cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)
        elif k >= 8192:
            cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=256, num_warps=4, num_stages=4)
        else:
            cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    elif triton.cdiv(m, 128) * triton.cdiv(n, 128) >= sms:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)
    elif triton.cdiv(m, 64) * triton.cdiv(n, 128) >= sms:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
    elif k >= 8192:  # few tiles: a long K keeps them busy with a deeper step
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=256, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    split = 1
    if triton.cdiv(m, cfg["BLOCK_M"]) == 1:
        # programs up to one wave, or about two per SM for 1-16 rows (as first measured there)
        most = sms if m <= 16 else sms // 2
        steps = triton.cdiv(k, cfg["BLOCK_K"])
        while tiles * split <= most and steps // (2 * split) >= 2 and split < 16:
            split *= 2
    cfg["SPLIT_K"] = split
    return cfg


def w8a8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              bias: Optional[torch.Tensor], out_dtype: torch.dtype, counters: Optional[torch.Tensor] = None,
              config: Optional[dict] = None) -> torch.Tensor:
    """a [M, K] (row scales a_scale fp32 [M] or [M, 1], contiguous) x b [N, K] (column scales b_scale fp32 [N]),
    both int8 or both float8_e4m3fn, (+ bias [N]) -> [M, N] in out_dtype. counters: `counters_for(N)` (the
    layer's, zero between launches); without them the K loop is not split. config: a `launch_config` dict for
    the tiled kernel, or {"GEMV": True[, "BLOCK_N": n, "num_warps": w, "WORDS": bool]} for the GEMV (benchmarks,
    tests); by default the GEMV up to W8A8_GEMV_MAX_ROWS rows (int8 on words: W8A8_GEMV_WORDS_MAX_ROWS) where a
    weight row fits its tile."""
    m, k = a.shape
    n = b.shape[0]
    assert b.shape[1] == k and a.stride(1) == 1 and b.stride(1) == 1
    assert a.dtype == b.dtype and a.dtype in (torch.int8, torch.float8_e4m3fn), (a.dtype, b.dtype)
    assert a_scale.numel() == m and a_scale.is_contiguous(), a_scale.shape
    floating = a.dtype != torch.int8
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if config is not None and config.get("GEMV"):
        _gemv(a, a_scale, b, b_scale, bias, out, config.get("BLOCK_N"), config.get("num_warps", 8),
              config.get("WORDS"))
        return out
    if config is None and triton.next_power_of_2(k) <= GEMV_TILE_BYTES and (
            m <= W8A8_GEMV_MAX_ROWS or (m <= W8A8_GEMV_WORDS_MAX_ROWS and _words_fit(a, b))):
        _gemv(a, a_scale, b, b_scale, bias, out)
        return out
    cfg = dict(config or launch_config(m, n, k, sm_count(a.device), floating))
    if counters is None or triton.cdiv(n, cfg["BLOCK_N"]) > counters.numel() or m > cfg["BLOCK_M"]:
        cfg["SPLIT_K"] = 1  # the counters count one row of output tiles
    split = cfg.pop("SPLIT_K")
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    part = out
    if split > 1:
        part = torch.empty(tiles * split * cfg["BLOCK_M"] * cfg["BLOCK_N"],
                           dtype=torch.float32 if floating else torch.int32, device=a.device)
    _w8a8_gemm_kernel[(tiles, split)](
        a, b, out, a_scale, b_scale, out if bias is None else bias, part, out if counters is None else counters,
        m, n, k, a.stride(0), b.stride(0), out.stride(0), k_per_split,
        GROUP_M=8, SPLIT_K=split, HAS_BIAS=bias is not None, EVEN_K=k % k_per_split == 0, FLOAT=floating,
        **cfg, **pdl_launch_args(a.device))
    return out
