"""Few-row weight-only GEMV over 4/8-bit weights in the tiled layout (`quantization/tiled.py`), on the CUDA cores.

At decode (1 to a few rows) the product is a pass over the packed weights, so the kernel is written to stream them:
- each program owns BLOCK_N output columns and a range of K tiles (split-K, so even N = 4096 gives every SM
  several programs); it loads whole tiles of [16, BLOCK_N] int32 words (16-byte loads along N) and holds the next
  tile's words in registers while it computes the current one; the first tile is loaded before
  `griddepcontrol.wait` (weights never depend on the previous kernel: see kernels/gemv.py);
- the tiled layout puts 16 consecutive input channels in each value plane of a tile, so one plane is one mask
  (`w & (MASK << s)`) and the 16 activations it multiplies are one contiguous load; the K sum of a plane stays
  inside each thread (warps split N, not K);
- unpacking avoids int -> float conversions (a quarter of the FMA rate): OR-ing the masked bits into the mantissa
  of 2**23 gives the float 2**23 + q * 2**s exactly, and one subtraction of 2**23 + zero * 2**s leaves
  (q - zero) * 2**s; the 2**-s goes into the group scale, applied once per plane and column;
- scales and zeros are read once per group (once per tile for group sizes >= a tile) and sums are fp32;
- the splits of a column block write fp32 partials; the last one to finish (an atomic counter per block, reset
  by it) adds them in split order, adds the bias and stores the output: one kernel, deterministic, no memset,
  CUDA-graph safe (the counters live with the layer).
`quant_gemv_ref` is the torch reference.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm import envs
from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel
from pagedllm.kernels.tiled_layout import dequantize_tiled

# Most rows one launch handles (one fp32 accumulator row per input row, unrolled).
QGEMV_MAX_ROWS = 8
MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2**23


@triton.jit
def plane_bits(src, j: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr):
    """Value plane j of a word tile as the float32 2**23 + q * 2**s, s = BITS * (j % (16 // BITS)); `src` is the
    words for the planes in the low 16 bits, the words >> 16 for the others (the masked bits OR-ed into the mantissa
    of 2**23: exact, no int -> float conversion). USE_ASM: one `lop3` for the AND and the OR (LLVM emits two)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    SH: tl.constexpr = BITS * (j % (16 // BITS))
    if USE_ASM:
        bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                         [src, tl.full(src.shape, MASK << SH, tl.int32),
                                          tl.full(src.shape, MAGIC, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (src & (MASK << SH)) | MAGIC
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def split_k_store(acc, rows, cols, m_ok, n_ok, part_ptr, cnt_ptr, bias_ptr, out_ptr, M, N, stride_om, pid_n, pid_k,
                  SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Store acc [BM, BN] (fp32): directly with one split, else as this split's partial; the last split of a
    column block to arrive adds all partials in split order (+ bias), stores the output and resets the counter."""
    mask = m_ok[:, None] & n_ok[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = part_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(part + pid_k * M * N, acc, mask=mask)
        # Triton issues a scalar atomic from one thread: the barrier first makes every warp's partial stores
        # part of what that thread's release publishes (without it a split can count itself done while another
        # warp's stores are still in flight, and the last split sums a stale partial). acq_rel: our partial is
        # visible before the count, and the last one sees every partial.
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # unrolled: the loads go out together
                total += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


# Row and tile counts are not specialized on (one compiled variant serves every batch size of a launch config;
# the tile loop's trip count stays a constant: the interpreter cannot loop over a scalar argument).
@triton.jit(do_not_specialize=["M", "NUM_CHUNKS"])
def _qgemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, stride_xm, stride_om, NUM_CHUNKS,
    BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, CHUNKS_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, USE_PDL: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = 16 * PACK
    ONE_GROUP: tl.constexpr = GROUP % TILE_K == 0  # the whole tile is in one group
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    r = tl.arange(0, ROWS)
    first = pid_k * CHUNKS_PER_SPLIT  # a chunk: ROWS word rows of one tile (ROWS divides 16)
    w_ptrs = qw_ptr + (first * ROWS + r)[:, None].to(tl.int64) * N + cols[None, :]
    # Weights first (see the module docstring); a split's chunks past the end load nothing.
    w = tl.load(w_ptrs, mask=n_ok[None, :] & (first < NUM_CHUNKS), other=0, eviction_policy="evict_first")
    wait_prior_kernel(USE_PDL)
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for t in range(CHUNKS_PER_SPLIT):
        chunk = first + t
        c_ok = chunk < NUM_CHUNKS
        w_next = tl.load(w_ptrs + (t + 1) * ROWS * N, mask=n_ok[None, :] & (chunk + 1 < NUM_CHUNKS) &
                         (t + 1 < CHUNKS_PER_SPLIT), other=0, eviction_policy="evict_first")
        k0 = (chunk * ROWS // 16) * TILE_K  # first channel of the chunk's tile
        k_in = (chunk * ROWS) % 16  # the chunk's first row in its tile
        if ONE_GROUP:
            g_off = (k0 // GROUP).to(tl.int64) * N
            s = tl.load(s_ptr + g_off + cols, mask=n_ok & c_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g_off + cols, mask=n_ok & c_ok, other=0.0).to(tl.float32)
        src = w
        for j in tl.static_range(PACK):
            if j == 16 // BITS:
                src = w >> 16  # the planes in the high half (w is dead from here: no extra registers)
            if not ONE_GROUP:
                if (16 * j) % GROUP == 0:  # a new group starts at this plane
                    g_off = ((k0 + 16 * j) // GROUP).to(tl.int64) * N
                    s = tl.load(s_ptr + g_off + cols, mask=n_ok & c_ok, other=0.0).to(tl.float32)
                    z = tl.load(z_ptr + g_off + cols, mask=n_ok & c_ok, other=0.0).to(tl.float32)
            # plane j holds (q << SH) with SH = BITS * (j % (16 // BITS)): (q - zero) * 2**SH, exact
            q = plane_bits(src, j, BITS, USE_ASM) - (z * (1 << (BITS * (j % (16 // BITS)))) + 8388608.0)[None, :]
            s_j = s * (1.0 / (1 << (BITS * (j % (16 // BITS)))))
            k_idx = k0 + 16 * j + k_in + r
            if HAS_PERM:
                k_idx = tl.load(perm_ptr + k_idx, mask=c_ok, other=0)
            for m in tl.static_range(BLOCK_M):
                xv = tl.load(x_ptr + m * stride_xm + k_idx, mask=c_ok & (m < M), other=0.0).to(tl.float32)
                p = tl.sum(q * xv[:, None], axis=0) * s_j
                if m == 0:
                    acc0 += p
                elif m == 1:
                    acc1 += p
                elif m == 2:
                    acc2 += p
                elif m == 3:
                    acc3 += p
                elif m == 4:
                    acc4 += p
                elif m == 5:
                    acc5 += p
                elif m == 6:
                    acc6 += p
                else:
                    acc7 += p
        w = w_next
    rows = tl.arange(0, BLOCK_M)
    acc = tl.where(rows[:, None] == 0, acc0[None, :], 0.0)
    if BLOCK_M > 1:
        acc = tl.where(rows[:, None] == 1, acc1[None, :], acc)
    if BLOCK_M > 2:
        acc = tl.where(rows[:, None] == 2, acc2[None, :], acc)
        acc = tl.where(rows[:, None] == 3, acc3[None, :], acc)
    if BLOCK_M > 4:
        acc = tl.where(rows[:, None] == 4, acc4[None, :], acc)
        acc = tl.where(rows[:, None] == 5, acc5[None, :], acc)
        acc = tl.where(rows[:, None] == 6, acc6[None, :], acc)
        acc = tl.where(rows[:, None] == 7, acc7[None, :], acc)
    split_k_store(acc, rows, cols, rows < M, n_ok, part_ptr, cnt_ptr, bias_ptr, out_ptr, M, N, stride_om,
                  pid_n, pid_k, SPLIT_K, HAS_BIAS)


def use_asm(device: torch.device) -> bool:
    """Inline PTX only on a real CUDA device (Triton's interpreter cannot run it)."""
    return device.type == "cuda" and not envs.TRITON_INTERPRET


def num_sms(device: torch.device) -> int:
    """The SMs the K split fills (8 off CUDA: small grids for Triton's interpreter)."""
    from pagedllm.kernels.paged_attention import sm_count

    return sm_count(device) if device.type == "cuda" else 8


# Launch parameters (benchmarks/quant.py --sweep times alternatives): columns and warps per program, word rows per
# load (8 or 16: registers per thread = 2 x rows x 4 words), how many programs per SM the K split aims for.
CONFIG = {"block_n": 256, "num_warps": 2, "rows": 4, "programs_per_sm": 4, "max_split": 16}


def split_for(programs: int, num_tiles: int, sms: int, programs_per_sm: int, max_split: int = 16) -> int:
    """The K split: a power of two, until `programs_per_sm` programs per SM, one tile per split or max_split."""
    split = 1
    while programs * split < programs_per_sm * sms and num_tiles // (2 * split) >= 1 and 2 * split <= max_split:
        split *= 2
    return split


def counters_for(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed split-K counters for a layer of n columns (one per column block of the narrowest block used)."""
    return torch.zeros(triton.cdiv(n, 32) + 1, dtype=torch.int32, device=device)


def quant_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               group_size: int, perm: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               counters: torch.Tensor, config: Optional[dict] = None) -> torch.Tensor:
    """x [M, K] (M <= QGEMV_MAX_ROWS, contiguous rows) @ dequant(W)^T (+ bias) -> [M, N] in x's dtype."""
    cfg = config or CONFIG
    m, k = x.shape
    n = qweight.shape[1]
    assert m <= QGEMV_MAX_ROWS and x.stride(1) == 1 and qweight.shape[0] * (32 // bits) == k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_n = min(cfg["block_n"], max(32, triton.next_power_of_2(n)))
    rows = cfg.get("rows", 4)
    num_chunks = k // (32 // bits) // rows
    n_blocks = triton.cdiv(n, block_n)
    split = cfg.get("split_k") or split_for(n_blocks, num_chunks, num_sms(x.device), cfg["programs_per_sm"],
                                              cfg.get("max_split", 16))
    assert counters.numel() >= n_blocks
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _qgemv_kernel[(n_blocks, split)](
        x, qweight, scales, zeros, perm if perm is not None else qweight, bias if bias is not None else scales,
        out, part, counters, m, n, x.stride(0), out.stride(0), num_chunks,
        BITS=bits, GROUP=group_size, ROWS=rows, CHUNKS_PER_SPLIT=triton.cdiv(num_chunks, split),
        SPLIT_K=split, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None, USE_ASM=use_asm(x.device), num_warps=cfg["num_warps"],
        **pdl_launch_args(x.device))
    return out


def quant_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                   group_size: int, perm: Optional[torch.Tensor], bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same product in fp32 torch over the dense dequantized weight, rounded once to x's dtype."""
    w = dequantize_tiled(qweight, scales.float(), zeros.float(), bits, group_size, perm)  # [N, K]
    out = x.float() @ w.t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
