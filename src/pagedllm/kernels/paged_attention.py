"""Paged attention kernels (Triton) and their pure-torch reference.

Two kernels read K/V through each request's block table from the paged cache
[2, num_blocks, block_size, num_kv_heads, head_size] (0 = K, 1 = V):

* `paged_prefill_attention`: any batch (prefill chunks, prefix-cache hits, decodes, speculative
  rows). Flash-attention style: one program owns a tile of BLOCK_Q query tokens x the GQA group of
  query heads sharing one kv head (BLOCK_M = BLOCK_Q * GQA_PAD rows), so each K/V tile is read once
  for the whole group; it streams K/V tiles with an online softmax. Programs are laid out over the
  flattened batch without any host-side planning: request i owns program ids
  [query_start_loc[i] // BLOCK_Q + i, ...) and each program finds its request by binary search.
* `paged_decode_attention`: batches where every request has exactly one query token. Split-KV
  ("flash decoding"): grid (num_kv_heads, num_seqs, num_splits); each program handles the GQA group
  of one kv head over one slice of the context and writes a partial result + log-sum-exp; a
  second kernel merges the slices. An optional order (rows longest context first) sets which
  requests' programs start first. The number of splits depends only on host values fixed for a
  CUDA graph (num_seqs, heads, SM count); each request's slice length is derived on the device
  from its seq_len, so replays with new seq_lens / block tables need no host work.

Semantics (shared with the torch backend): request i's query tokens are
query_start_loc[i]:query_start_loc[i+1], the LAST query_len tokens of a context of seq_lens[i]
tokens already in the cache; query token j sees context positions < seq_len - query_len + j + 1;
query head h reads kv head h // (num_heads // num_kv_heads). A request with seq_len 0 yields zeros.
With a sliding window W (transformers' mask) a query at position p sees only positions p - W < k <= p; both
kernels then start at the first position a program's rows can see and never read the blocks before it (the KV
manager may have freed them: their block-table entries are stale). With a logits soft cap c (Gemma 2) each scaled
score s becomes c * tanh(s / c) before the softmax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm import envs
from pagedllm.kernels.lora import store_partial_and_fold
from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel
from pagedllm.kernels.qkv_prep import head_norm_product

LOG2E = 1.4426950408889634
# The `window` the kernels get without a sliding window: larger than any context, so it never hides a key.
NO_WINDOW = 1 << 30


def kernel_window(sliding_window: Optional[int]) -> int:
    return NO_WINDOW if sliding_window is None else int(sliding_window)


def kernel_soft_cap(logits_soft_cap: Optional[float]) -> float:
    """The cap in the kernels' log2 units (their scores are s * log2(e)); 0.0 without one (never read)."""
    return 0.0 if logits_soft_cap is None else float(logits_soft_cap) * LOG2E


# ----------------------------------------------------------------------------------------------
# shared pieces
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # exp-based, so the interpreter runs it too; saturates to +-1 (exp overflows to inf or underflows to 0)
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _find_seq_idx(query_start_loc_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i in [0, num_seqs) with query_start_loc[i] // BLOCK_Q + i <= target."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# How a bf16 query reads an E4M3 cache. "fp16": the tiles compute in fp16 (E4M3 widens to fp16 in one conversion
# instruction per pair, to bf16 in two steps; every E4M3 value is exact in fp16, and q and p gain precision);
# "bf16": the cache widens to the query's dtype (the A/B: benchmarks/kernels_attention.py --fp8-read).
FP8_KV_COMPUTE = "fp16"


def fp8_read_args(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> dict:
    """The kernels' Q_FP16 constant for a query and cache dtype (off unless the cache is E4M3)."""
    return dict(Q_FP16=cache_dtype == torch.float8_e4m3fn and query_dtype == torch.bfloat16
                and FP8_KV_COMPUTE == "fp16")


@triton.jit
def _fp16_query(q):
    # fp16's range ends at 65504 (bf16's does not): clamp rather than overflow to inf.
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


# An E4M3 V tile as 32-bit words: the P @ V dot needs V's positions (its reduction axis) packed in each register, a
# transpose that Triton does for 8-bit tiles with one shared-memory byte load per element (LDS.U8; sm_90 SASS of
# the decode kernel). Widened to fp16 in the load layout first, the tile goes through shared memory as fp16
# (STS.128, then ldmatrix.trans) like a 16-bit cache's, and the kernel needs fewer registers.
FP8_V_WORDS = True  # False: the byte read (the A/B: kernels_attention.py --fp8-read fp16 fp16-vw)
_INTERPRETED = tl.constexpr(envs.TRITON_INTERPRET)


@triton.jit
def _e4m3_words_to_f16(w):
    """w: uint32 [R, C], four E4M3 bytes each (byte j = element 4c + j) -> fp16 [R, 4C]."""
    if _INTERPRETED:  # no inline asm in the interpreter: s.eeee.mmm -> s.0eeee.mmm0000000 = value * 2^-8
        o0 = ((((w & 0x80) << 8) | ((w & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True) * 256.0)
        o1 = ((((w & 0x8000)) | ((w & 0x7F00) >> 1)).to(tl.uint16).to(tl.float16, bitcast=True) * 256.0)
        o2 = ((((w >> 8) & 0x8000) | ((w >> 9) & 0x3F80)).to(tl.uint16).to(tl.float16, bitcast=True) * 256.0)
        o3 = ((((w >> 16) & 0x8000) | ((w >> 17) & 0x3F80)).to(tl.uint16).to(tl.float16, bitcast=True) * 256.0)
    else:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi;
            .reg .b32 r0, r1;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 r0, lo;
            cvt.rn.f16x2.e4m3x2 r1, hi;
            mov.b32 {$0, $1}, r0;
            mov.b32 {$2, $3}, r1;
            }""",
            constraints="=h,=h,=h,=h,r", args=[w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)
    # tl.join stacks on a new minor axis: element 4c + 2x + y of the row is [c, x, y] = o_{2x+y}
    v = tl.join(tl.join(o0, o2), tl.join(o1, o3))
    return tl.reshape(v, [w.shape[0], w.shape[1] * 4])


@triton.jit
def _attend_tile(
    acc, m_i, l_i,  # running state: [M, HEAD_PAD] fp32, [M] fp32 (log2 units), [M] fp32
    q,  # [M, HEAD_PAD] in the input dtype
    q_pos,  # [M] absolute position of each query row (used when CAUSAL or WINDOWED)
    cache_ptr, bt_row_ptr, head_off,  # K cache base, this request's block-table row, kv-head offset
    start, kv_end,  # tile covers positions start + [0, BLOCK_N); positions >= kv_end are masked
    stride_c_kv, stride_c_blk, stride_c_slot, scale_log2,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BOUNDED: tl.constexpr,  # mask positions >= kv_end (False only when the whole tile is < kv_end)
    CAUSAL: tl.constexpr,  # mask positions > q_pos
    kv_lo=0, window=0,  # WINDOWED: positions < kv_lo are never read; row r sees only positions > q_pos[r] - window
    WINDOWED: tl.constexpr = False,
    soft_cap_log2=0.0,  # SOFT_CAP: the cap c in log2 units (c * log2(e)); scores s become c * tanh(s / c)
    SOFT_CAP: tl.constexpr = False,
    V_WORDS: tl.constexpr = False,  # an E4M3 V read as 32-bit words and widened to fp16 before its layout change
):
    pos = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_PAD)
    # Physical block of each position; the cache offset is int64 (caches exceed 2^31 elements).
    if WINDOWED:
        # Blocks before the window may be freed: neither their table entries nor their slots are read.
        pos_ok = (pos < kv_end) & (pos >= kv_lo)
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    elif BOUNDED:
        pos_ok = pos < kv_end
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    else:
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE)
    offs = blk.to(tl.int64) * stride_c_blk + (pos % BLOCK_SIZE) * stride_c_slot + head_off
    ptrs = cache_ptr + offs[:, None] + dims[None, :]
    if BOUNDED or WINDOWED:
        # V must be zeroed (not just ignored) past kv_end: stale cache memory may hold NaNs.
        kv_mask = pos_ok[:, None] & (dims < HEAD_SIZE)[None, :]
        k = tl.load(ptrs, mask=kv_mask, other=0.0)
        v = tl.load(ptrs + stride_c_kv, mask=kv_mask, other=0.0)
    elif HEAD_PAD != HEAD_SIZE:
        kv_mask = (pos >= 0)[:, None] & (dims < HEAD_SIZE)[None, :]
        k = tl.load(ptrs, mask=kv_mask, other=0.0)
        v = tl.load(ptrs + stride_c_kv, mask=kv_mask, other=0.0)
    else:
        k = tl.load(ptrs)
        v = tl.load(ptrs + stride_c_kv)
    k = k.to(q.dtype)
    if V_WORDS:  # (the E4M3 loads of v above are dead code then, removed by the compiler)
        words = tl.arange(0, HEAD_PAD // 4)
        vw_base = (cache_ptr + stride_c_kv + offs[:, None]).to(tl.pointer_type(tl.uint32), bitcast=True)
        vw_ptrs = vw_base + words[None, :]
        if BOUNDED or WINDOWED:
            vw = tl.load(vw_ptrs, mask=pos_ok[:, None] & (words < HEAD_SIZE // 4)[None, :], other=0)
        elif HEAD_PAD != HEAD_SIZE:
            vw = tl.load(vw_ptrs, mask=(pos >= 0)[:, None] & (words < HEAD_SIZE // 4)[None, :], other=0)
        else:
            vw = tl.load(vw_ptrs)
        v = _e4m3_words_to_f16(vw)
    else:
        v = v.to(q.dtype)

    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, BLOCK_N]
    if SOFT_CAP:  # qk = s * log2(e), so c * tanh(s / c) * log2(e) = cap * tanh(qk / cap) with cap = c * log2(e)
        qk = soft_cap_log2 * _tanh(qk / soft_cap_log2)
    if WINDOWED:
        seen = pos_ok[None, :] & (pos[None, :] > q_pos[:, None] - window)
        if CAUSAL:
            seen = seen & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(seen, qk, float("-inf"))
    elif CAUSAL:
        qk = tl.where(pos[None, :] <= q_pos[:, None], qk, float("-inf"))
    elif BOUNDED:
        qk = tl.where(pos_ok[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if WINDOWED:
        # A row may see nothing of its first tiles (its window starts further on): m stays -inf, and the
        # exponentials use 0 instead so they give 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        # Invariant: the first tile a row sees has at least one visible position, so m_new is finite.
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# ----------------------------------------------------------------------------------------------
# mixed batch / prefill
# ----------------------------------------------------------------------------------------------


# Integer arguments that change from step to step (batch size, the block table's width, split counts) are not
# specialized on: Triton would otherwise compile a variant for value 1 and for multiples of 16, seconds each on
# a slow host, in the middle of serving.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "window"])
def _prefill_kernel(
    q_ptr, out_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr, out_scale_ptr,
    scale_log2, num_seqs, window, soft_cap_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, stride_bt,
    GQA: tl.constexpr, GQA_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    WINDOWED: tl.constexpr = False,  # a sliding window (`window` positions)
    SOFT_CAP: tl.constexpr = False,  # soft-capped scores (soft_cap_log2)
    Q_FP16: tl.constexpr = False,  # a bf16 query reads an E4M3 cache in fp16 (fp8_read_args)
    OUT_SCALE: tl.constexpr = False,  # the output times *out_scale_ptr (an FP8 cache's v_scale)
):
    wait_prior_kernel(USE_PDL)
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq_idx(query_start_loc_ptr, pid_q, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    num_q_blocks = tl.cdiv(q_len, BLOCK_Q)
    local = pid_q - (q_start // BLOCK_Q + seq)
    if local >= num_q_blocks:
        return
    # Launch a request's last (longest, under the causal mask) query tiles first: shorter tail.
    q_block = num_q_blocks - 1 - local
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens cached before this chunk

    # Row r of the tile = query token q_block*BLOCK_Q + r // GQA_PAD, head kv_head*GQA + r % GQA_PAD.
    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GQA_PAD
    g = rows % GQA_PAD
    head = kv_head * GQA + g
    row_mask = (tok < q_len) & (g < GQA)
    dims = tl.arange(0, HEAD_PAD)
    io_mask = row_mask[:, None] & (dims < HEAD_SIZE)[None, :]
    tok64 = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=io_mask, other=0.0)
    if Q_FP16:
        q = _fp16_query(q)
    q_pos = ctx_len + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_c_head

    # Keys every row of the tile sees: positions <= ctx_len + q_block*BLOCK_Q (the first row's).
    kv_end = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)  # last row's limit (<= seq_len)
    full_end = (ctx_len + q_block * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    mid_start = 0
    causal_start = full_end
    if WINDOWED:
        # The first row sees positions from kv_lo on; every row sees all of [kv_end - window, its causal limit].
        # Tiles before mid_start are masked by window (and causally), the rest as without a window.
        kv_lo = tl.maximum(ctx_len + q_block * BLOCK_Q - window + 1, 0)
        mid_start = tl.minimum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N,
                               tl.cdiv(kv_end, BLOCK_N) * BLOCK_N)
        for start in range(kv_lo // BLOCK_N * BLOCK_N, mid_start, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, cache_ptr, bt_row_ptr, head_off, start, kv_end,
                stride_c_kv, stride_c_blk, stride_c_slot, scale_log2,
                BLOCK_N, BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, DOT_PRECISION, BOUNDED=True, CAUSAL=True,
                kv_lo=kv_lo, window=window, WINDOWED=True, soft_cap_log2=soft_cap_log2, SOFT_CAP=SOFT_CAP)
        causal_start = tl.maximum(full_end, mid_start)
    for start in range(mid_start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, cache_ptr, bt_row_ptr, head_off, start, kv_end,
            stride_c_kv, stride_c_blk, stride_c_slot, scale_log2,
            BLOCK_N, BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, DOT_PRECISION, BOUNDED=False, CAUSAL=False,
            soft_cap_log2=soft_cap_log2, SOFT_CAP=SOFT_CAP)
    for start in range(causal_start, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, cache_ptr, bt_row_ptr, head_off, start, kv_end,
            stride_c_kv, stride_c_blk, stride_c_slot, scale_log2,
            BLOCK_N, BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, DOT_PRECISION, BOUNDED=True, CAUSAL=True,
            soft_cap_log2=soft_cap_log2, SOFT_CAP=SOFT_CAP)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if OUT_SCALE:
        out = out * tl.load(out_scale_ptr)
    tl.store(out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _scale_arg(out_scale: Optional[torch.Tensor], placeholder: torch.Tensor) -> torch.Tensor:
    """The kernels' out_scale_ptr: the float32 scale, or any tensor when there is none (OUT_SCALE off: unread)."""
    if out_scale is None:
        return placeholder
    assert out_scale.dtype == torch.float32 and out_scale.numel() >= 1 and out_scale.device == placeholder.device
    return out_scale


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (tl.dot would otherwise use tf32 on tensor cores).
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_shapes(query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor) -> tuple[int, int, int, int]:
    num_tokens, num_heads, head_size = query.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[4] == head_size, (
        kv_cache.shape, query.shape)
    num_kv_heads = kv_cache.shape[3]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert query.stride(-1) == 1 and output.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert output.shape == query.shape, (output.shape, query.shape)
    return num_tokens, num_heads, head_size, num_kv_heads


def prefill_block_m(dtype: torch.dtype, gqa: int, head_size: int, max_query_len: Optional[int]) -> int:
    """The prefill kernel's query tile BLOCK_M (= BLOCK_Q query tokens x GQA_PAD heads): the largest that fits,
    smaller for short query chunks (decodes, speculative rows) when max_query_len is given."""
    gqa_pad = triton.next_power_of_2(gqa)
    max_m = 64 if (dtype == torch.float32 or triton.next_power_of_2(head_size) > 128) else 128
    if max_query_len is None:
        return max(max_m, gqa_pad, 16)
    return max(min(max_m, max(16, triton.next_power_of_2(max(1, max_query_len)) * gqa_pad)), gqa_pad, 16)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size], already written
    block_table: torch.Tensor,  # [>= num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [>= num_seqs] int32
    query_start_loc: torch.Tensor,  # [>= num_seqs + 1] int32
    scale: float,
    num_seqs: int,
    max_query_len: int,
    output: Optional[torch.Tensor] = None,  # [num_tokens, num_heads, head_size]
    block_m: Optional[int] = None,  # tuning overrides (benchmarks); None = built-in choice
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    out_scale: Optional[torch.Tensor] = None,  # float32 [1] on the device: the output is multiplied by it
) -> torch.Tensor:
    """Causal attention for any mixture of prefill chunks and decodes (no host syncs), optionally within a sliding
    window (a query at position p sees keys p - sliding_window < k <= p) and with soft-capped scores."""
    if output is None:
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_heads, head_size, num_kv_heads = _check_shapes(query, kv_cache, output)
    if num_tokens == 0 or num_seqs == 0:
        return output
    gqa = num_heads // num_kv_heads
    gqa_pad = triton.next_power_of_2(gqa)
    head_pad = triton.next_power_of_2(head_size)
    is_fp32 = query.dtype == torch.float32
    if block_m is None:
        block_m = prefill_block_m(query.dtype, gqa, head_size, max_query_len)
    block_m = max(block_m, gqa_pad, 16)
    block_q = block_m // gqa_pad
    if block_n is None:
        block_n = 32 if (is_fp32 or head_pad > 128) else 64
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 1 if is_fp32 else 3
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, output, kv_cache, block_table, seq_lens, query_start_loc, _scale_arg(out_scale, output),
        scale * LOG2E, num_seqs, kernel_window(sliding_window), kernel_soft_cap(logits_soft_cap),
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
        GQA=gqa, GQA_PAD=gqa_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[2], HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        DOT_PRECISION=_dot_precision(query.dtype), WINDOWED=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None, num_warps=num_warps, num_stages=num_stages,
        OUT_SCALE=out_scale is not None, **fp8_read_args(query.dtype, kv_cache.dtype), **pdl_launch_args(query.device),
    )
    return output


@triton.jit
def _store_slice(
    acc, m_i, l_i,  # a program's running state over its slice of the context
    out_rows, po_rows, pl_rows,  # out / part_out / part_lse at each row's query token (a scalar or per row)
    head, dims, io_mask, row_ok, part_ok,  # part_ok: whether the slice's parts are stored (a scalar)
    split, out_scale_ptr, stride_oh, stride_po_head, stride_po_split, stride_pl_head,
    SINGLE_SPLIT: tl.constexpr, OUT_SCALE: tl.constexpr,
):
    """One split-KV program's result: the normalized output (one split), else the slice's output and its log2-domain
    log-sum-exp for the reduce kernel (lse -inf where a row saw nothing: weight 0 there)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if SINGLE_SPLIT:
        if OUT_SCALE:
            out = out * tl.load(out_scale_ptr)
        tl.store(out_rows + head[:, None] * stride_oh + dims[None, :], out.to(out_rows.dtype.element_ty),
                 mask=io_mask)
    else:
        tl.store(po_rows + head[:, None] * stride_po_head + split * stride_po_split + dims[None, :], out,
                 mask=io_mask & part_ok)
        tl.store(pl_rows + head * stride_pl_head + split, m_i + tl.log2(l_safe), mask=row_ok & part_ok)


# ----------------------------------------------------------------------------------------------
# decode (split-KV)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _prep_rows(row_ptr, heads, row_ok, dims, cos, sin, w, wp, eps,
               HEAD_SIZE: tl.constexpr, HAS_NORM: tl.constexpr, FP32_PRODUCT: tl.constexpr, ROTATE: tl.constexpr):
    """Heads `heads` of one projection row ([R, HEAD_PAD], in the row's dtype), as kernels/qkv_prep.py leaves them:
    per-head RMSNorm (HAS_NORM, weights w and their rotation partners wp; its two roundings, or one with
    FP32_PRODUCT) and neox rope with `cos` / `sin` (ROTATE; _prep_inputs), the result rounded once. The rotation's
    partner of each dim is a second load of the same row."""
    half: tl.constexpr = HEAD_SIZE // 2
    dim_ok = dims < HEAD_SIZE
    mask = row_ok[:, None] & dim_ok[None, :]
    partner = tl.where(dims < half, dims + half, dims - half)
    x = tl.load(row_ptr + heads[:, None] * HEAD_SIZE + dims[None, :], mask=mask, other=0.0)
    if not ROTATE:
        return x
    xp = tl.load(row_ptr + heads[:, None] * HEAD_SIZE + partner[None, :], mask=mask, other=0.0)
    f = x.to(tl.float32)
    fp = xp.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(f * f, 1) / HEAD_SIZE + eps)[:, None]
        f = head_norm_product(f, rstd, w, x, FP32_PRODUCT)
        fp = head_norm_product(fp, rstd, wp, x, FP32_PRODUCT)
    # neox: out[d] = x[d] cos - x[d + half] sin (first half), x[d] cos + x[d - half] sin (second half)
    sign = tl.where(dims < half, -1.0, 1.0)[None, :]
    return (f * cos + sign * fp * sin).to(x.dtype)


@triton.jit
def _prep_rope(pos, cos_sin_ptr, stride_cs, dims, HEAD_SIZE: tl.constexpr):
    """The rope's cos and sin at `pos` for each dim ([1, HEAD_PAD] float32; _prep_rows)."""
    half: tl.constexpr = HEAD_SIZE // 2
    dim_ok = dims < HEAD_SIZE
    cs = cos_sin_ptr + pos.to(tl.int64) * stride_cs
    cos = tl.load(cs + dims % half, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs + half + dims % half, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _prep_norm_weight(w_ptr, dims, HEAD_SIZE: tl.constexpr):
    """A per-head norm's weights and their rotation partners' ([1, HEAD_PAD] float32; _prep_rows)."""
    half: tl.constexpr = HEAD_SIZE // 2
    dim_ok = dims < HEAD_SIZE
    partner = tl.where(dims < half, dims + half, dims - half)
    w = tl.load(w_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    wp = tl.load(w_ptr + partner, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    return w, wp


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_po_seq", "stride_po_head", "stride_pl_seq",
                                "stride_pl_head", "window"])
def _decode_kernel(
    q_ptr, out_ptr, part_out_ptr, part_lse_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, order_ptr, out_scale_ptr,
    scale_log2, num_splits, window, soft_cap_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, stride_bt,
    stride_po_seq, stride_po_head, stride_po_split,  # part_out [num_seqs, num_heads, num_splits, HEAD_PAD]
    stride_pl_seq, stride_pl_head,  # part_lse [num_seqs, num_heads, num_splits]
    GQA: tl.constexpr, GQA_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,  # num_splits == 1: write the normalized output directly
    HAS_ORDER: tl.constexpr,  # order_ptr lists the rows longest context first
    USE_PDL: tl.constexpr,
    SOFT_CAP: tl.constexpr = False,  # soft-capped scores (soft_cap_log2)
    Q_FP16: tl.constexpr = False,  # a bf16 query reads an E4M3 cache in fp16 (fp8_read_args)
    OUT_SCALE: tl.constexpr = False,  # the output times *out_scale_ptr (SINGLE_SPLIT; else the reduce applies it)
    V_WORDS: tl.constexpr = False,  # (Q_FP16 only: V widens to fp16)
    # PREP: q_ptr is the qkv projection's output (rows of NUM_Q q heads, then k, then v heads), before
    # kernels/qkv_prep.py: each program normalizes (HAS_NORM) and rotates its q heads itself, and the program
    # whose slice ends at the query computes the new K / V row and writes it to the cache before it attends.
    positions_ptr=None, cos_sin_ptr=None, q_w_ptr=None, k_w_ptr=None, slot_ptr=None, stride_cs=0, eps=0.0,
    PREP: tl.constexpr = False, NUM_Q: tl.constexpr = 1, NUM_KV: tl.constexpr = 1, HAS_NORM: tl.constexpr = False,
    FP32_PRODUCT: tl.constexpr = False,
):
    dims = tl.arange(0, HEAD_PAD)
    if PREP:
        # The step's inputs (not the previous kernel's results): read before the PDL wait, under its tail.
        if HAS_ORDER:
            seq = tl.load(order_ptr + tl.program_id(1))
        else:
            seq = tl.program_id(1)
        pos = tl.load(positions_ptr + seq.to(tl.int64))
        slot = tl.load(slot_ptr + seq.to(tl.int64)).to(tl.int64)
        cos, sin = _prep_rope(pos, cos_sin_ptr, stride_cs, dims, HEAD_SIZE)
        if HAS_NORM:
            q_w, q_wp = _prep_norm_weight(q_w_ptr, dims, HEAD_SIZE)
            k_w, k_wp = _prep_norm_weight(k_w_ptr, dims, HEAD_SIZE)
        else:
            q_w, q_wp, k_w, k_wp = cos, cos, cos, cos  # (unused)
        wait_prior_kernel(USE_PDL)
    else:
        wait_prior_kernel(USE_PDL)
        if HAS_ORDER:
            seq = tl.load(order_ptr + tl.program_id(1))
        else:
            seq = tl.program_id(1)
    # Grid (kv heads, requests, splits): programs are dispatched kv head fastest, so with an order every head
    # of the longest contexts starts first and the short ones fill the tail (longest-processing-time first).
    kv_head = tl.program_id(0)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The query (at seq_len - 1) sees [lo, seq_len): all of it without a sliding window (window = NO_WINDOW).
    lo = tl.maximum(seq_len - window, 0)
    # Each split covers a slice of a multiple of BLOCK_N positions from lo; the reduce kernel recomputes the same.
    part_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * part_len
    end = tl.minimum(start + part_len, seq_len)

    rows = tl.arange(0, GQA_PAD)
    head = kv_head * GQA + rows
    row_ok = rows < GQA
    io_mask = row_ok[:, None] & (dims < HEAD_SIZE)[None, :]
    seq64 = seq.to(tl.int64)
    if PREP:
        row_ptr = q_ptr + seq64 * stride_qt
        q = _prep_rows(row_ptr, head, row_ok, dims, cos, sin, q_w, q_wp, eps, HEAD_SIZE, HAS_NORM, FP32_PRODUCT,
                       True)
        if (start < end) & (end == seq_len) & (slot >= 0):  # the slice holding the query's own position
            one = tl.arange(0, 1)
            kv_row = NUM_Q + kv_head + one  # [1]
            k_new = tl.sum(_prep_rows(row_ptr, kv_row, one == 0, dims, cos, sin, k_w, k_wp, eps, HEAD_SIZE,
                                      HAS_NORM, FP32_PRODUCT, True).to(tl.float32), 0)
            v_new = tl.sum(_prep_rows(row_ptr, kv_row + NUM_KV, one == 0, dims, cos, sin, k_w, k_wp, eps,
                                      HEAD_SIZE, HAS_NORM, FP32_PRODUCT, False).to(tl.float32), 0)
            k_new = k_new.to(cache_ptr.dtype.element_ty)
            v_new = v_new.to(cache_ptr.dtype.element_ty)
            blk_base = cache_ptr + (slot // BLOCK_SIZE) * stride_c_blk
            d_ok = dims < HEAD_SIZE
            tl.store(blk_base + (slot % BLOCK_SIZE) * stride_c_slot + kv_head.to(tl.int64) * stride_c_head + dims,
                     k_new, mask=d_ok)
            v_dst = (slot % BLOCK_SIZE) * stride_c_slot + kv_head.to(tl.int64) * stride_c_head + dims
            tl.store(blk_base + stride_c_kv + v_dst, v_new, mask=d_ok)
        # The context loop reads the new row back from the cache like any other (no per-tile substitution): the
        # barrier makes every thread's store of it visible to the program's loads.
        tl.debug_barrier()
    else:
        q = tl.load(q_ptr + seq64 * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=io_mask, other=0.0)
    if Q_FP16:
        q = _fp16_query(q)

    m_i = tl.full([GQA_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GQA_PAD], tl.float32)
    acc = tl.zeros([GQA_PAD, HEAD_PAD], tl.float32)
    bt_row_ptr = block_table_ptr + seq64 * stride_bt
    head_off = kv_head.to(tl.int64) * stride_c_head
    for tile_start in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, m_i, cache_ptr, bt_row_ptr, head_off, tile_start, end,
            stride_c_kv, stride_c_blk, stride_c_slot, scale_log2,
            BLOCK_N, BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, DOT_PRECISION, BOUNDED=True, CAUSAL=False,
            soft_cap_log2=soft_cap_log2, SOFT_CAP=SOFT_CAP, V_WORDS=V_WORDS)

    has_work = start < end  # empty trailing splits write nothing; the reducer skips them
    _store_slice(acc, m_i, l_i, out_ptr + seq64 * stride_ot, part_out_ptr + seq64 * stride_po_seq,
                 part_lse_ptr + seq64 * stride_pl_seq, head, dims, io_mask, row_ok, has_work, split, out_scale_ptr,
                 stride_oh, stride_po_head, stride_po_split, stride_pl_head, SINGLE_SPLIT, OUT_SCALE)


@triton.jit(do_not_specialize=["num_splits", "stride_po_seq", "stride_po_head", "stride_pl_seq", "stride_pl_head",
                                "window"])
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, out_scale_ptr, num_splits, window,
    stride_ot, stride_oh, stride_po_seq, stride_po_head, stride_po_split, stride_pl_seq, stride_pl_head,
    a_ptr, slot_ptr, fold_part_ptr, h_ptr, counter_ptr, NR, stride_as, stride_an, stride_fp_head, stride_fp_seq,
    stride_hm,
    BLOCK_N: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
    FOLD: tl.constexpr = False,  # also the consumer's shrink of the output (OutputShrink)
    NR_PAD: tl.constexpr = 16, NUM_HEADS: tl.constexpr = 1,
    OUT_SCALE: tl.constexpr = False,  # the output times *out_scale_ptr (an FP8 cache's v_scale)
    ALL_SPLITS: tl.constexpr = False,  # rows are query tokens and every split wrote its part (few-query launches)
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    if FOLD:  # the token's slot and A's columns of this head are written before the forward: load them first
        slot = tl.load(slot_ptr + seq)
        offs_q = tl.arange(0, NR_PAD)
        q_ok = offs_q < NR
        a = tl.load(a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_as + offs_q[:, None] * stride_an
                    + head * HEAD_SIZE + dims[None, :], mask=q_ok[:, None] & dim_ok[None, :] & (slot >= 0),
                    other=0.0).to(tl.float32)
    wait_prior_kernel(USE_PDL)
    if ALL_SPLITS:
        num_active = num_splits  # a split a row saw nothing of holds lse -inf and zeros: weight 0
    else:
        seq_len = tl.load(seq_lens_ptr + seq)
        num_keys = seq_len - tl.maximum(seq_len - window, 0)  # the keys the query sees (its window)
        part_len = tl.maximum(tl.cdiv(tl.cdiv(num_keys, num_splits), BLOCK_N) * BLOCK_N, 1)
        num_active = tl.cdiv(num_keys, part_len)  # splits that had work (0 when seq_len == 0)

    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_active
    seq64 = seq.to(tl.int64)
    lse = tl.load(part_lse_ptr + seq64 * stride_pl_seq + head * stride_pl_head + splits,
                  mask=split_ok, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)  # 0 for inactive splits
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    po = part_out_ptr + seq64 * stride_po_seq + head * stride_po_head
    parts = tl.load(po + splits[:, None] * stride_po_split + dims[None, :],
                    mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / denom
    if OUT_SCALE:
        out = out * tl.load(out_scale_ptr)
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + seq64 * stride_ot + head * stride_oh + dims, out, mask=dim_ok)
    if FOLD:
        if slot >= 0:  # this head's share of A[slot] @ out[seq]; the last head of the row adds them up in order
            part = tl.sum(a * out.to(tl.float32)[None, :], axis=1)
            store_partial_and_fold(part, fold_part_ptr, head, stride_fp_head, seq * stride_fp_seq, offs_q, q_ok,
                                   h_ptr + seq * stride_hm, counter_ptr + seq, NUM_HEADS, NR_PAD)


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_po_row", "stride_po_head", "stride_pl_row",
                                "stride_pl_head", "window"])
def _few_query_kernel(
    q_ptr, out_ptr, part_out_ptr, part_lse_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_scale_ptr, scale_log2, num_splits, window, soft_cap_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, stride_bt,
    stride_po_row, stride_po_head, stride_po_split,  # part_out [num_tokens, num_heads, num_splits, HEAD_PAD]
    stride_pl_row, stride_pl_head,  # part_lse [num_tokens, num_heads, num_splits]
    GQA: tl.constexpr, GQA_PAD: tl.constexpr, Q_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,  # num_splits == 1: write the normalized output directly
    USE_PDL: tl.constexpr,
    SOFT_CAP: tl.constexpr = False,
    Q_FP16: tl.constexpr = False,
    OUT_SCALE: tl.constexpr = False,  # (SINGLE_SPLIT; else the reduce applies it)
    V_WORDS: tl.constexpr = False,
):
    wait_prior_kernel(USE_PDL)
    # Grid (kv heads, requests, splits): every query token of a request (<= Q_PAD) and the GQA group of one kv
    # head as the rows of one tile, over one slice of the context, so each K/V tile is read once for all of them.
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len > 0:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_len = seq_len - q_len
        # The first token (at ctx_len) sees [lo, ...); later tokens see less of the start under a window.
        lo = tl.maximum(ctx_len + 1 - window, 0)
        part_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
        start = lo + split * part_len
        end = tl.minimum(start + part_len, seq_len)

        rows = tl.arange(0, Q_PAD * GQA_PAD)
        tok = rows // GQA_PAD
        g = rows % GQA_PAD
        head = kv_head * GQA + g
        row_ok = (tok < q_len) & (g < GQA)
        dims = tl.arange(0, HEAD_PAD)
        io_mask = row_ok[:, None] & (dims < HEAD_SIZE)[None, :]
        tok64 = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=io_mask,
                    other=0.0)
        if Q_FP16:
            q = _fp16_query(q)
        q_pos = ctx_len + tok

        m_i = tl.full([Q_PAD * GQA_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([Q_PAD * GQA_PAD], tl.float32)
        acc = tl.zeros([Q_PAD * GQA_PAD, HEAD_PAD], tl.float32)
        bt_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
        head_off = kv_head.to(tl.int64) * stride_c_head
        # The masked tile form throughout (bounds, causality, window): a row may see nothing of a split (a later
        # slice than its position), which only that form's -inf handling allows.
        for tile_start in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, cache_ptr, bt_row_ptr, head_off, tile_start, end,
                stride_c_kv, stride_c_blk, stride_c_slot, scale_log2,
                BLOCK_N, BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, DOT_PRECISION, BOUNDED=True, CAUSAL=True,
                kv_lo=lo, window=window, WINDOWED=True, soft_cap_log2=soft_cap_log2, SOFT_CAP=SOFT_CAP,
                V_WORDS=V_WORDS)

        # Every split writes, the empty ones zeros and lse -inf: the reduce needs no request lengths.
        _store_slice(acc, m_i, l_i, out_ptr + tok64[:, None] * stride_ot, part_out_ptr + tok64[:, None] * stride_po_row,
                     part_lse_ptr + tok64 * stride_pl_row, head, dims, io_mask, row_ok, q_len > 0, split, out_scale_ptr,
                     stride_oh, stride_po_head, stride_po_split, stride_pl_head, SINGLE_SPLIT, OUT_SCALE)


# Few-query launches (`paged_few_query_attention`): at most this many query tokens per request, and tiles of at most
# FEW_QUERY_MAX_ROWS rows (query tokens padded to a power of two x the GQA group padded).
FEW_QUERY_MAX_LEN = 16
FEW_QUERY_MAX_ROWS = 64


def few_query_pad(max_query_len: int, num_heads: int, num_kv_heads: int) -> Optional[int]:
    """The query tokens per tile (a power of two) of a few-query launch for requests of <= max_query_len tokens,
    or None when such a launch does not apply (too many tokens or rows)."""
    gqa_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    q_pad = max(triton.next_power_of_2(max(1, max_query_len)), 16 // min(16, gqa_pad))  # tl.dot: >= 16 rows
    if max_query_len > FEW_QUERY_MAX_LEN or q_pad * gqa_pad > FEW_QUERY_MAX_ROWS:
        return None
    return q_pad


def few_query_workspace_numel(num_kv_heads: int, num_heads: int, head_size: int,
                              device: torch.device) -> tuple[int, int]:
    """Worst-case (part_out, part_lse) element counts of few-query launches: the decode workspace's rows x splits
    bound, times FEW_QUERY_MAX_LEN query tokens per request (the backend counts a request per that many tokens at
    least when it picks the splits)."""
    return tuple(FEW_QUERY_MAX_LEN * n for n in decode_workspace_numel(num_kv_heads, num_heads, head_size, device))


def _split_kv_meta(query: torch.Tensor, kv_cache: torch.Tensor, gqa: int, gqa_pad: int, block_n: int, num_warps: int,
                   num_stages: int, logits_soft_cap: Optional[float], out_scale: Optional[torch.Tensor]) -> dict:
    """The compile-time arguments the split-KV kernels (decode, few-query) share."""
    head_size = query.shape[2]
    meta = dict(GQA=gqa, GQA_PAD=gqa_pad, BLOCK_N=block_n, BLOCK_SIZE=kv_cache.shape[2], HEAD_SIZE=head_size,
                HEAD_PAD=triton.next_power_of_2(head_size), DOT_PRECISION=_dot_precision(query.dtype),
                SOFT_CAP=logits_soft_cap is not None, num_warps=num_warps, num_stages=num_stages,
                OUT_SCALE=out_scale is not None, **fp8_read_args(query.dtype, kv_cache.dtype),
                **pdl_launch_args(query.device))
    # V as 32-bit words: whole words per position (head_size % 4) at 4-byte aligned addresses
    meta["V_WORDS"] = (meta["Q_FP16"] and FP8_V_WORDS and head_size % 4 == 0 and kv_cache.data_ptr() % 4 == 0
                       and all(st % 4 == 0 for st in kv_cache.stride()[:4]))
    return meta


def _cache_strides(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple:
    return (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0))


def paged_few_query_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size], already written
    block_table: torch.Tensor,  # [>= num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [>= num_seqs] int32
    query_start_loc: torch.Tensor,  # [>= num_seqs + 1] int32
    scale: float,
    num_seqs: int,
    q_pad: int,  # query tokens per tile: >= every request's query length (few_query_pad)
    output: Optional[torch.Tensor] = None,
    workspace: Optional[tuple[torch.Tensor, torch.Tensor]] = None,  # flat fp32 (part_out, part_lse)
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: int = 4,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    out_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention for requests of a few query tokens each (speculative verify rows, decodes), the semantics
    of `paged_prefill_attention`, split-KV as `paged_decode_attention`: the prefill kernel gives such a request one
    program per kv head, which walks the whole context alone; here a request's context is cut into num_splits
    slices (each program: all its query tokens x one GQA group x one slice), merged by the decode reduce kernel.
    No host syncs; the launch depends only on num_seqs, q_pad, num_splits and shapes (CUDA-graph capturable with
    a preallocated workspace)."""
    if output is None:
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_heads, head_size, num_kv_heads = _check_shapes(query, kv_cache, output)
    if num_tokens == 0 or num_seqs == 0:
        return output
    gqa = num_heads // num_kv_heads
    gqa_pad = triton.next_power_of_2(gqa)
    head_pad = triton.next_power_of_2(head_size)
    assert q_pad * gqa_pad >= 16 and q_pad == triton.next_power_of_2(q_pad), (q_pad, gqa_pad)
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, query.device, cache_dtype=kv_cache.dtype)
    if block_n is None:
        block_n = decode_block_n(query.dtype, head_size, num_splits, cache_dtype=kv_cache.dtype)
    common = dict(Q_PAD=q_pad, **_split_kv_meta(query, kv_cache, gqa, gqa_pad, block_n, num_warps,
                                                 decode_num_stages(kv_cache.dtype, num_splits), logits_soft_cap,
                                                 out_scale))
    scale_arg = _scale_arg(out_scale, output)
    window, soft_cap = kernel_window(sliding_window), kernel_soft_cap(logits_soft_cap)
    cache_strides = _cache_strides(kv_cache, block_table)
    head_strides = (query.stride(0), query.stride(1), output.stride(0), output.stride(1))
    if num_splits == 1:
        _few_query_kernel[(num_kv_heads, num_seqs, 1)](
            query, output, output, output, kv_cache, block_table, seq_lens, query_start_loc, scale_arg,
            scale * LOG2E, 1, window, soft_cap, *head_strides, *cache_strides, 0, 0, 0, 0, 0, SINGLE_SPLIT=True,
            **common)
        return output
    part_out, part_lse, part_strides = split_kv_partials(workspace, num_tokens, num_heads, num_splits, head_pad,
                                                         query.device)
    _few_query_kernel[(num_kv_heads, num_seqs, num_splits)](
        query, output, part_out, part_lse, kv_cache, block_table, seq_lens, query_start_loc, scale_arg,
        scale * LOG2E, num_splits, window, soft_cap, *head_strides, *cache_strides, *part_strides,
        SINGLE_SPLIT=False, **common)
    # Rows of tokens of no request (graph padding) merge whatever their workspace rows hold: nothing reads them.
    _decode_reduce_kernel[(num_tokens, num_heads)](
        output, part_out, part_lse, seq_lens, scale_arg, num_splits, window,
        output.stride(0), output.stride(1), *part_strides, output, seq_lens, output, output, seq_lens,
        0, 0, 0, 0, 0, 0,
        BLOCK_N=block_n, HEAD_SIZE=head_size, HEAD_PAD=head_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
        OUT_SCALE=out_scale is not None, ALL_SPLITS=True, num_warps=4 if head_pad >= 128 else 2,
        **pdl_launch_args(query.device))
    return output


@dataclass
class OutputShrink:
    """A LoRA shrink of the attention output [T, num_heads * head_size] that the split-KV reduce computes on the
    way (`paged_decode_attention(shrink=)`): h[0, t] = a[token_slots[t]] @ out[t] (fp32, of the rounded output) for
    each row t with a slot (>= 0). `done` tells the caller whether it was computed (a launch without the reduce
    kernel, one split, leaves it to the consumer)."""

    a: torch.Tensor  # [S, NR, num_heads * head_size], contiguous
    token_slots: torch.Tensor  # [>= T] int32, -1: no adapter
    counters: torch.Tensor  # [>= T] int32 zeros, left zero
    h: torch.Tensor  # [1, >= T, NR] fp32
    done: bool = False


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


# Aim for about this many decode programs per SM (measured on H200: fewer leaves bandwidth unused).
_DECODE_PROGRAMS_PER_SM = 8


# Decode steps whose longest context is at most SHORT_CONTEXT_LEN use at most SHORT_CONTEXT_MAX_SPLITS splits:
# a split covers >= BLOCK_N positions, so most of 64 splits would be empty there, and empty programs still
# cost launch slots; long contexts need all 64 (docs/benchmarks.md, GPU section). CUDA graphs are captured for both.
SHORT_CONTEXT_LEN = 2048
SHORT_CONTEXT_MAX_SPLITS = 16
# Split decode steps whose longest context is at most TINY_CONTEXT_LEN read K/V in tiles of 32 positions instead of
# 64: more of the splits get work; from ~1024 tokens on, 64-position tiles are faster (docs/benchmarks.md).
TINY_CONTEXT_LEN = 512


def decode_block_n(dtype: torch.dtype, head_size: int, num_splits: int, max_seq_len: Optional[int] = None,
                   cache_dtype: Optional[torch.dtype] = None) -> int:
    """K/V positions per tile of the decode kernel (an E4M3 cache: twice as many, the same bytes per tile)."""
    if dtype == torch.float32 or triton.next_power_of_2(head_size) > 128:
        return 32
    if num_splits > 1 and max_seq_len is not None and max_seq_len <= TINY_CONTEXT_LEN:
        return 32
    return 128 if cache_dtype == torch.float8_e4m3fn else 64


def decode_num_stages(cache_dtype: torch.dtype, num_splits: int) -> int:
    """Pipeline stages of the decode kernel: 3, or 2 for an E4M3 cache's 128-position tiles when the context is
    split (the sweep of kernels_attention.py --gqa-sweep --kv-dtype fp8)."""
    return 2 if cache_dtype == torch.float8_e4m3fn and num_splits > 1 else 3


def decode_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device, max_splits: int = 64,
                      max_seq_len: Optional[int] = None, cache_dtype: Optional[torch.dtype] = None) -> int:
    """Splits per (request, kv head): the largest power of two keeping num_seqs * kv_heads * splits
    <= 8 programs per SM (16 with an E4M3 cache, whose tiles wait on conversions more than on memory), powers of two
    cutting typical contexts into even slices, at most SHORT_CONTEXT_MAX_SPLITS when every context is <=
    SHORT_CONTEXT_LEN (max_seq_len, an upper bound).

    Depends only on values fixed for a captured CUDA graph (batch size, heads, device, cache, context bucket).
    """
    target = _DECODE_PROGRAMS_PER_SM * sm_count(device) * (2 if cache_dtype == torch.float8_e4m3fn else 1)
    ratio = target // max(1, num_seqs * num_kv_heads)
    if ratio <= 1:
        return 1
    if max_seq_len is not None and max_seq_len <= SHORT_CONTEXT_LEN:
        max_splits = min(max_splits, SHORT_CONTEXT_MAX_SPLITS)
    return min(max_splits, 1 << (ratio.bit_length() - 1))


def decode_workspace_numel(num_kv_heads: int, num_heads: int, head_size: int, device: torch.device,
                           max_splits: int = 64) -> tuple[int, int]:
    """Worst-case (part_out, part_lse) element counts over every batch size and cache dtype; allocate once."""
    target = 2 * _DECODE_PROGRAMS_PER_SM * sm_count(device)
    # splits > 1 only when num_seqs * kv_heads * splits <= target, so num_seqs * splits <= target / kv_heads.
    rows = triton.cdiv(target, num_kv_heads) + 1
    return rows * num_heads * triton.next_power_of_2(head_size), rows * num_heads


def split_kv_partials(workspace: Optional[tuple[torch.Tensor, torch.Tensor]], rows: int, num_heads: int,
                      num_splits: int, head_pad: int, device: torch.device):
    """Split-KV partial outputs and log-sum-exps for `rows` query rows, views of `workspace` (persistent buffers
    under CUDA graphs) or new tensors, and their strides as the kernels take them."""
    out_numel = rows * num_heads * num_splits * head_pad
    lse_numel = rows * num_heads * num_splits
    if workspace is None:
        part_out = torch.empty(out_numel, dtype=torch.float32, device=device)
        part_lse = torch.empty(lse_numel, dtype=torch.float32, device=device)
    else:
        part_out, part_lse = workspace
        assert part_out.numel() >= out_numel and part_lse.numel() >= lse_numel, "split-KV workspace too small"
    part_out = part_out[:out_numel].view(rows, num_heads, num_splits, head_pad)
    part_lse = part_lse[:lse_numel].view(rows, num_heads, num_splits)
    strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1))
    return part_out, part_lse, strides


@dataclass
class DecodePrep:
    """kernels/qkv_prep.py's work for `paged_decode_attention` to do itself (its `query` is then the q part of the
    projection output, not yet normalized or rotated, whose rows go on with the k and v heads)."""

    positions: torch.Tensor  # [>= num_seqs]
    cos_sin_cache: torch.Tensor  # [max_position, head_size] = cat(cos, sin)
    slot_mapping: torch.Tensor  # [>= num_seqs]: where each request's new K / V go (negative: nowhere)
    q_norm_weight: Optional[torch.Tensor] = None  # [head_size], both or neither
    k_norm_weight: Optional[torch.Tensor] = None
    eps: float = 1e-6


def paged_decode_attention(
    query: torch.Tensor,  # [num_tokens >= num_seqs, num_heads, head_size]; row i = request i's token
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size], already written
    block_table: torch.Tensor,  # [>= num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [>= num_seqs] int32
    scale: float,
    num_seqs: int,
    output: Optional[torch.Tensor] = None,
    workspace: Optional[tuple[torch.Tensor, torch.Tensor]] = None,  # flat fp32 (part_out, part_lse)
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: int = 4,
    num_stages: Optional[int] = None,  # decode_num_stages
    order: Optional[torch.Tensor] = None,  # [>= num_seqs] int32: a permutation of the rows, longest context first
    sliding_window: Optional[int] = None,  # the query (at seq_len - 1) sees only the last sliding_window keys
    logits_soft_cap: Optional[float] = None,  # scores s become c * tanh(s / c) (Gemma 2)
    shrink: Optional[OutputShrink] = None,  # computed by the reduce kernel when the launch splits the context
    out_scale: Optional[torch.Tensor] = None,  # float32 [1] on the device: the output is multiplied by it
    prep: Optional[DecodePrep] = None,  # the q / k norm, rope and KV write of qkv_prep, done in this launch
) -> torch.Tensor:
    """One query token per request; split-KV over the context. CUDA-graph capturable when the
    workspace is preallocated (shapes depend only on num_seqs and the model's heads). With `prep`, `query` is a view
    of the qkv projection's rows ([:, :num_heads * head_size]) and the cache gets this step's K / V here.

    `order` only changes which programs start first: longest contexts first shortens the tail of long contexts
    at the end of the grid (docs/benchmarks.md, run S); any permutation is correct."""
    if output is None:
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_heads, head_size, num_kv_heads = _check_shapes(query, kv_cache, output)
    if num_seqs == 0:
        return output
    assert num_tokens >= num_seqs, (num_tokens, num_seqs)
    gqa = num_heads // num_kv_heads
    gqa_pad = max(16, triton.next_power_of_2(gqa))  # tl.dot needs M >= 16
    head_pad = triton.next_power_of_2(head_size)
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, query.device, cache_dtype=kv_cache.dtype)
    if block_n is None:
        block_n = decode_block_n(query.dtype, head_size, num_splits, cache_dtype=kv_cache.dtype)
    if num_stages is None:
        num_stages = decode_num_stages(kv_cache.dtype, num_splits)
    launch = pdl_launch_args(query.device)
    common = dict(HAS_ORDER=order is not None, **_split_kv_meta(query, kv_cache, gqa, gqa_pad, block_n, num_warps,
                                                               num_stages, logits_soft_cap, out_scale))
    common.update(_prep_args(prep, query, kv_cache, num_heads, num_kv_heads, head_size, out_scale))
    scale_arg = _scale_arg(out_scale, output)
    order_arg = seq_lens if order is None else order  # (unread without an order)
    window, soft_cap = kernel_window(sliding_window), kernel_soft_cap(logits_soft_cap)
    cache_strides = _cache_strides(kv_cache, block_table)
    if num_splits == 1:
        _decode_kernel[(num_kv_heads, num_seqs, 1)](
            query, output, output, output, kv_cache, block_table, seq_lens, order_arg, scale_arg, scale * LOG2E, 1,
            window, soft_cap, query.stride(0), query.stride(1), output.stride(0), output.stride(1), *cache_strides,
            0, 0, 0, 0, 0, SINGLE_SPLIT=True, **common)
        return output

    part_out, part_lse, part_strides = split_kv_partials(workspace, num_seqs, num_heads, num_splits, head_pad,
                                                         query.device)
    _decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        query, output, part_out, part_lse, kv_cache, block_table, seq_lens, order_arg, scale_arg, scale * LOG2E,
        num_splits, window, soft_cap,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1), *cache_strides,
        *part_strides, SINGLE_SPLIT=False, **common)
    fold_args, fold_meta = (output, seq_lens, output, output, seq_lens, 0, 0, 0, 0, 0, 0), {}  # (unread)
    if shrink is not None:
        a, h = shrink.a, shrink.h
        assert a.is_contiguous() and a.shape[2] == num_heads * head_size and shrink.counters.numel() >= num_seqs
        nr = a.shape[1]
        fold_part = torch.empty((num_heads, num_seqs, nr), dtype=torch.float32, device=query.device)
        fold_args = (a, shrink.token_slots, fold_part, h, shrink.counters, nr, a.stride(0), a.stride(1),
                     fold_part.stride(0), fold_part.stride(1), h.stride(1))
        fold_meta = dict(FOLD=True, NR_PAD=max(16, triton.next_power_of_2(nr)), NUM_HEADS=num_heads)
        shrink.done = True
    _decode_reduce_kernel[(num_seqs, num_heads)](
        output, part_out, part_lse, seq_lens, scale_arg, num_splits, window,
        output.stride(0), output.stride(1), *part_strides, *fold_args,
        BLOCK_N=block_n, HEAD_SIZE=head_size, HEAD_PAD=head_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
        OUT_SCALE=out_scale is not None, num_warps=4 if head_pad >= 128 else 2, **fold_meta, **launch)
    return output


def _prep_args(prep: Optional[DecodePrep], query: torch.Tensor, kv_cache: torch.Tensor, num_heads: int,
               num_kv_heads: int, head_size: int, out_scale) -> dict:
    if prep is None:
        return {}
    norm = prep.q_norm_weight
    assert (norm is None) == (prep.k_norm_weight is None)
    assert kv_cache.dtype == query.dtype and out_scale is None, "the decode prep writes an unscaled 16-bit cache"
    assert query.stride(2) == 1 and query.stride(1) == head_size and head_size % 2 == 0, query.stride()
    assert query.stride(0) >= (num_heads + 2 * num_kv_heads) * head_size, "query must be a view of the qkv rows"
    assert prep.cos_sin_cache.shape[-1] == head_size and prep.cos_sin_cache.stride(-1) == 1
    return dict(positions_ptr=prep.positions, cos_sin_ptr=prep.cos_sin_cache,
                q_w_ptr=norm if norm is not None else query, k_w_ptr=prep.k_norm_weight if norm is not None else query,
                slot_ptr=prep.slot_mapping, stride_cs=prep.cos_sin_cache.stride(0), eps=float(prep.eps), PREP=True,
                NUM_Q=num_heads, NUM_KV=num_kv_heads, HAS_NORM=norm is not None,
                FP32_PRODUCT=norm is not None and norm.dtype == torch.float32 and query.dtype != torch.float32)


# ----------------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------------


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    num_seqs: Optional[int] = None,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
) -> torch.Tensor:
    """Pure-torch reference (per-request loop, fp32 math). Rows of no request stay zero. With a sliding window
    only the blocks holding a row's visible keys are read; with a soft cap c scores s become c * tanh(s / c)."""
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    gqa = num_heads // num_kv_heads
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if num_seqs is None:
        num_seqs = len(lens)
    out = torch.zeros_like(query)
    for i in range(num_seqs):
        q0, q1, seq_len = qsl[i], qsl[i + 1], lens[i]
        q_len = q1 - q0
        if q_len == 0 or seq_len == 0:
            continue
        key_start = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)
        first_block = key_start // block_size
        blocks = block_table[i, first_block: math.ceil(seq_len / block_size)].long()
        keys = slice(key_start - first_block * block_size, seq_len - first_block * block_size)
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_size)[keys].float()
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_size)[keys].float()
        k = k.repeat_interleave(gqa, dim=1)  # [seq_len, num_heads, head_size]
        v = v.repeat_interleave(gqa, dim=1)
        q = query[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(key_start, seq_len, device=query.device)
        hidden = k_pos[None, None, :] > q_pos[None, :, None]
        if sliding_window is not None:
            hidden |= k_pos[None, None, :] <= q_pos[None, :, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
