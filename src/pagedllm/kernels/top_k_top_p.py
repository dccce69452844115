"""Each row's top-k / top-p cutoff logit without sorting, in one launch and no host sync (Triton).

The kept set and its reference are described in layers/top_k_top_p.py (the torch search, this kernel's
reference, and the sort-based `sampler.apply_top_k_top_p_sort`). Here each program owns one row and narrows a
bracket [lo, hi] of *keys*: a float's bits mapped to an int32 that orders like the float (-0.0 taken as +0.0,
so the keys of equal values are equal). A pass reads the row once, splits the bracket into NB buckets of
2^s keys, and sums per bucket the weight (1 for top-k's count, exp(x - max) for top-p's mass), with the
smallest and largest key present in the bracket; the bucket where the weight of the tokens from the top reaches
the target becomes the next bracket, clipped to those keys. The search ends when the bracket holds one key
(or one distinct key is left in it): its value is the cutoff. The keys span 32 bits and each pass removes at
least log2(NB) of them (the bucket width is the smallest power of two that fits the bracket in NB buckets), so
MAX_PASSES = 32 / log2(NB) passes always end it: the bound is exact, not a guess, and `converged` (returned for
the tests) is always true.

Per row: one statistics pass (max, smallest and largest key), then up to MAX_PASSES for top-k (rows with a
top-k) and up to MAX_PASSES for top-p (rows with top_p < 1, within the top-k set; its bracket starts at the
bound of layers/top_k_top_p.py, a few dozen nats below the max). A row with neither reads nothing. Blocks of
the row with no token in the bracket skip the bucket sums, so a narrow bracket costs about the read.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_INT32_MAX = tl.constexpr(2147483647)
_INT32_MIN = tl.constexpr(-2147483648)


@triton.jit
def _key(v):
    """float32 -> int32 with the float's order; -0.0 -> the key of +0.0."""
    v = tl.where(v == 0.0, 0.0, v)
    bits = v.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _value(key):
    """The inverse of _key (the map is its own inverse on the bits)."""
    key = key.to(tl.int32)
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _search(row_ptr, vocab, lo, hi, target_scale, row_max, floor_key,
            MASS: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, MAX_PASSES: tl.constexpr,
            NUM_STAGES: tl.constexpr):
    """Narrow [lo, hi] (int64 keys, inclusive, holding the answer) to the largest key whose weight of tokens at or
    above it reaches the target. Counts (MASS False): target = target_scale. Mass: target = target_scale x the
    mass of the tokens at or above floor_key (the top-k set), summed in the same pass as the buckets (every
    weight in the bracket is > 0: it starts a few dozen nats below the max). Returns (lo, hi, passes)."""
    offs = tl.arange(0, BLOCK)
    buckets = tl.arange(0, NB)
    shifts = tl.arange(0, 64).to(tl.int64)
    passes = 0
    for _ in range(MAX_PASSES):
        if lo < hi:
            passes += 1
            # The smallest s with (hi - lo) >> s < NB: buckets of 2^s keys.
            s = tl.sum((((hi - lo) >> shifts) >= NB).to(tl.int64), axis=0)
            acc_w = tl.zeros([BLOCK, NB], dtype=tl.float32)
            acc_above = tl.zeros([BLOCK], dtype=tl.float32)
            acc_set = tl.zeros([BLOCK], dtype=tl.float32)
            acc_lo = tl.full([BLOCK], _INT32_MAX, dtype=tl.int32)  # the keys present in the bracket
            acc_hi = tl.full([BLOCK], _INT32_MIN, dtype=tl.int32)
            for start in tl.range(0, vocab, BLOCK, num_stages=NUM_STAGES):
                cols = start + offs
                ok = cols < vocab
                v = tl.load(row_ptr + cols, mask=ok, other=float("-inf"))
                key = _key(v)
                key64 = key.to(tl.int64)
                if MASS:
                    w = tl.where(ok & (key64 >= floor_key), tl.exp(v - row_max), 0.0)
                    acc_set += w
                else:
                    w = tl.where(ok, 1.0, 0.0)
                acc_above += tl.where(key64 > hi, w, 0.0)
                inside = ok & (key64 >= lo) & (key64 <= hi)
                acc_lo = tl.minimum(acc_lo, tl.where(inside, key, _INT32_MAX))
                acc_hi = tl.maximum(acc_hi, tl.where(inside, key, _INT32_MIN))
                if tl.max(inside.to(tl.int32), axis=0) > 0:  # a narrow bracket skips most blocks
                    bucket = ((key64 - lo) >> s).to(tl.int32)
                    hit = (bucket[:, None] == buckets[None, :]) & inside[:, None]
                    acc_w += tl.where(hit, w[:, None], 0.0)
            sums = tl.sum(acc_w, axis=0)
            data_lo = tl.min(acc_lo, axis=0).to(tl.int64)
            data_hi = tl.max(acc_hi, axis=0).to(tl.int64)
            above = tl.sum(acc_above, axis=0)
            if MASS:
                target = target_scale * tl.sum(acc_set, axis=0)
            else:
                target = target_scale
            # Weight of the tokens at or above each bucket: above + the buckets from it up.
            from_top = above + tl.sum(tl.where(buckets[None, :] >= buckets[:, None], sums[None, :], 0.0), axis=1)
            nonempty = sums > 0
            reach = tl.max(tl.where(nonempty & (from_top >= target), buckets, -1), axis=0)
            # Rounding can leave no bucket reaching the target: the lowest non-empty one then (a superset by a
            # rounding's worth of mass).
            lowest = tl.min(tl.where(nonempty, buckets, NB), axis=0)
            chosen = tl.where(reach >= 0, reach, lowest).to(tl.int64)
            new_lo = tl.maximum(lo + (chosen << s), data_lo)
            new_hi = tl.minimum(lo + ((chosen + 1) << s) - 1, data_hi)
            # One key left in the bracket: it is the answer.
            lo = tl.where(data_lo == data_hi, data_lo, new_lo)
            hi = tl.where(data_lo == data_hi, data_hi, new_hi)
    return lo, hi, passes


@triton.jit(do_not_specialize=["vocab"])
def _top_k_top_p_cutoff_kernel(x_ptr, stride_x, vocab, k_ptr, p_ptr, cutoff_ptr, passes_ptr, converged_ptr,
                               HAS_K: tl.constexpr, HAS_P: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                               MAX_PASSES: tl.constexpr, NUM_STAGES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    k = vocab
    p = 1.0
    if HAS_K:
        k = tl.load(k_ptr + row)
    if HAS_P:
        p = tl.load(p_ptr + row)
    # A row without a filter (greedy, or temperature only) reads nothing.
    end = tl.where((k < vocab) | (p < 1.0), vocab, 0)
    # Statistics: the max, and the smallest / largest key (the top-k bracket).
    acc_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    acc_klo = tl.full([BLOCK], _INT32_MAX, dtype=tl.int32)
    acc_khi = tl.full([BLOCK], _INT32_MIN, dtype=tl.int32)
    for start in range(0, end, BLOCK):
        cols = start + offs
        ok = cols < vocab
        v = tl.load(row_ptr + cols, mask=ok, other=float("-inf"))
        key = _key(v)
        acc_max = tl.maximum(acc_max, v)
        acc_klo = tl.minimum(acc_klo, tl.where(ok, key, _INT32_MAX))
        acc_khi = tl.maximum(acc_khi, tl.where(ok, key, _INT32_MIN))
    row_max = tl.max(acc_max, axis=0)
    key_lo = tl.min(acc_klo, axis=0).to(tl.int64)
    key_hi = tl.max(acc_khi, axis=0).to(tl.int64)

    cutoff = float("-inf")
    floor_key = key_lo
    passes = 0
    converged = 1
    if HAS_K:
        if k < vocab:
            lo, hi, n = _search(row_ptr, vocab, key_lo, key_hi, k.to(tl.float32), row_max, key_lo,
                                False, BLOCK, NB, MAX_PASSES, NUM_STAGES)
            cutoff = _value(lo)
            floor_key = lo
            passes += n
            converged = converged & (lo == hi).to(tl.int32)
    if HAS_P:
        if p < 1.0:
            # layers/top_k_top_p.py: every token below this bound together weighs less than 1 - p of the set.
            bound = tl.maximum(cutoff, row_max + tl.log((1.0 - p) / vocab) - 1.0)
            lo0 = tl.maximum(_key(bound).to(tl.int64), floor_key)
            lo, hi, n = _search(row_ptr, vocab, lo0, key_hi, p, row_max, floor_key, True, BLOCK, NB, MAX_PASSES,
                                NUM_STAGES)
            cutoff = _value(lo)
            passes += n
            converged = converged & (lo == hi).to(tl.int32)
    tl.store(cutoff_ptr + row, cutoff)
    tl.store(passes_ptr + row, passes)
    tl.store(converged_ptr + row, converged)


# The tile: 512 x 16 with 8 warps fits two programs per SM without spilling (ptxas for sm_90: docs/benchmarks.md).
_BLOCK = 512
_NB = 16
_MAX_PASSES = 8  # 32 key bits / log2(_NB)
# Software pipelining of the search passes' loads (tl.range num_stages): 1 = none. 3 pipelines them through
# cp.async at the price of one program per SM; which wins is for a GPU measurement (docs/benchmarks.md).
_NUM_STAGES = 1


def top_k_top_p_cutoff(logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
                       with_stats: bool = False):
    """logits [N, V] float32 (rows contiguous); top_k [N] int64 (>= V: none) or None; top_p [N] float32 (1: none)
    or None -> cutoff [N] float32 (-inf: keep all); with_stats: (cutoff, passes [N] int32, converged [N] int32)."""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    cutoff = torch.empty(n, dtype=torch.float32, device=logits.device)
    passes = torch.empty(n, dtype=torch.int32, device=logits.device)
    converged = torch.empty(n, dtype=torch.int32, device=logits.device)
    if n:
        _top_k_top_p_cutoff_kernel[(n,)](
            logits, logits.stride(0), vocab, cutoff if top_k is None else top_k, cutoff if top_p is None else top_p,
            cutoff, passes, converged, HAS_K=top_k is not None, HAS_P=top_p is not None, BLOCK=_BLOCK, NB=_NB,
            MAX_PASSES=_MAX_PASSES, NUM_STAGES=_NUM_STAGES, num_warps=8)
    return (cutoff, passes, converged) if with_stats else cutoff
