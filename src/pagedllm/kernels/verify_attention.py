"""Split-KV decode attention for a few query tokens per request (speculative verify rows), Triton.

A verify step gives each request 1 + k query tokens (its last token and k drafts) at the end of its context.
The prefill kernel handles them, but it runs one program per (query tile, kv head): at batch 1 that is a few
programs reading the whole context, on a GPU of 132 SMs. This kernel is the decode kernel's shape instead:
grid (kv heads, requests, splits), each program owning one slice of one request's context for the GQA group of
one kv head and *every* query token of the request (BLOCK_M = Q_PAD x GQA_PAD rows), so each K/V tile is read
once for all of them, and the split count follows the decode kernel's rule (the same program count as a plain
decode step of the same batch). A second kernel merges the splits per query token.

Causal masking inside the drafted span: query token j of a request with q_len tokens and seq_len context sees
positions <= seq_len - q_len + j. A split may then hold no visible position for some rows (the last split of a
context that ends inside the drafted span): those rows keep m = -inf, l = 0, and their partial gets weight 0 in
the merge (split 0 always holds position 0, visible to every row).

Layout and semantics are the prefill kernel's (kernels/paged_attention.py): request i's query tokens are
query_start_loc[i]:query_start_loc[i+1]; requests with no query tokens or seq_len 0 write nothing (their
programs exit), so CUDA graphs can pad the request rows. Grids depend on host ints fixed for a graph only
(num_seqs, splits, Q_PAD).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm.kernels.paged_attention import (LOG2E, _check_shapes, _dot_precision, decode_block_n, decode_num_splits,
                                             split_kv_partials)
from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel

# Most query tokens per request this kernel takes (k + 1 of a verify step; speculation allows k <= 32, but
# longer spans are cheaper in the prefill kernel's taller tiles).
VERIFY_MAX_QUERY_LEN = 16


def verify_block_m(max_query_len: int, gqa: int) -> int:
    return max(16, triton.next_power_of_2(max_query_len) * triton.next_power_of_2(gqa))


def verify_kernel_applies(max_query_len: int, num_heads: int, num_kv_heads: int, head_size: int,
                          dtype: torch.dtype) -> bool:
    """Whether a step whose longest query is max_query_len tokens takes this kernel (else the prefill kernel):
    a few query tokens, and a tile of at most 128 (fp32 or wide heads: 64) rows."""
    if not 1 < max_query_len <= VERIFY_MAX_QUERY_LEN:
        return False
    max_m = 64 if (dtype == torch.float32 or triton.next_power_of_2(head_size) > 128) else 128
    return verify_block_m(max_query_len, num_heads // num_kv_heads) <= max_m


def verify_workspace_numel(num_kv_heads: int, num_heads: int, head_size: int, max_query_len: int,
                           device: torch.device, max_splits: int = 64) -> tuple[int, int]:
    """Worst-case (part_out, part_lse) element counts of split launches with query spans <= max_query_len."""
    from pagedllm.kernels.paged_attention import _DECODE_PROGRAMS_PER_SM, sm_count

    rows = (triton.cdiv(_DECODE_PROGRAMS_PER_SM * sm_count(device), num_kv_heads) + 1) * max_query_len
    return rows * num_heads * triton.next_power_of_2(head_size), rows * num_heads


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_po_tok", "stride_po_head", "stride_pl_tok",
                                "stride_pl_head"])
def _verify_kernel(
    q_ptr, out_ptr, part_out_ptr, part_lse_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, stride_bt,
    stride_po_tok, stride_po_head, stride_po_split,  # part_out [num_tokens, num_heads, num_splits, HEAD_PAD]
    stride_pl_tok, stride_pl_head,  # part_lse [num_tokens, num_heads, num_splits]
    GQA: tl.constexpr, GQA_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_prior_kernel(USE_PDL)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    part_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * part_len
    end = tl.minimum(start + part_len, seq_len)

    # Row r = query token r // GQA_PAD of the request, head kv_head * GQA + r % GQA_PAD.
    rows = tl.arange(0, BLOCK_M)
    tok = rows // GQA_PAD
    g = rows % GQA_PAD
    head = kv_head * GQA + g
    row_ok = (tok < q_len) & (g < GQA)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    io_mask = row_ok[:, None] & dim_ok[None, :]
    tok64 = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=io_mask,
                other=0.0)
    # Row limit (exclusive): its own position + 1, within the split.
    limit = tl.minimum(seq_len - q_len + tok + 1, end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_c_head
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        offs = blk.to(tl.int64) * stride_c_blk + (pos % BLOCK_SIZE) * stride_c_slot + head_off
        ptrs = cache_ptr + offs[:, None] + dims[None, :]
        kv_mask = pos_ok[:, None] & dim_ok[None, :]  # zero (not just ignore) past the end: stale slots may be NaN
        k = tl.load(ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(ptrs + stride_c_kv, mask=kv_mask, other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        qk = tl.where(pos[None, :] < limit[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at zero
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if SINGLE_SPLIT:
        tl.store(out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        work = (rows * 0 + start) < end  # empty trailing splits write nothing; the merge skips them
        po = part_out_ptr + tok64[:, None] * stride_po_tok + head[:, None] * stride_po_head + split * stride_po_split
        tl.store(po + dims[None, :], out, mask=io_mask & work[:, None])
        lse = m_i + tl.log2(l_safe)  # log2-domain log-sum-exp of this slice (-inf: nothing visible)
        pl = part_lse_ptr + tok64 * stride_pl_tok + head * stride_pl_head + split
        tl.store(pl, lse, mask=row_ok & work)


@triton.jit(do_not_specialize=["num_splits", "stride_po_tok", "stride_po_head", "stride_pl_tok", "stride_pl_head"])
def _verify_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, query_start_loc_ptr, num_splits,
    stride_ot, stride_oh, stride_po_tok, stride_po_head, stride_po_split, stride_pl_tok, stride_pl_head,
    BLOCK_N: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_prior_kernel(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    j = tl.program_id(2)  # query token of the request
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if j >= q_len:
        return
    part_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, 1)
    num_active = tl.cdiv(seq_len, part_len)  # splits that had work (0 when seq_len == 0)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_active
    tok64 = (q_start + j).to(tl.int64)
    lse = tl.load(part_lse_ptr + tok64 * stride_pl_tok + head * stride_pl_head + splits, mask=split_ok,
                  other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)  # 0 for inactive splits and for splits this token sees nothing of
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    po = part_out_ptr + tok64 * stride_po_tok + head * stride_po_head
    parts = tl.load(po + splits[:, None] * stride_po_split + dims[None, :],
                    mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / denom
    tl.store(out_ptr + tok64 * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_verify_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size], already written
    block_table: torch.Tensor,  # [>= num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [>= num_seqs] int32
    query_start_loc: torch.Tensor,  # [>= num_seqs + 1] int32
    scale: float,
    num_seqs: int,
    max_query_len: int,  # an upper bound of every request's query tokens (<= VERIFY_MAX_QUERY_LEN)
    output: Optional[torch.Tensor] = None,
    workspace: Optional[tuple[torch.Tensor, torch.Tensor]] = None,  # flat fp32 (part_out, part_lse)
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Causal attention of a few query tokens per request, split-KV over the context (no host syncs;
    CUDA-graph capturable with a preallocated workspace)."""
    if output is None:
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens, num_heads, head_size, num_kv_heads = _check_shapes(query, kv_cache, output)
    if num_seqs == 0 or num_tokens == 0:
        return output
    assert 1 <= max_query_len <= VERIFY_MAX_QUERY_LEN, max_query_len
    gqa = num_heads // num_kv_heads
    gqa_pad = triton.next_power_of_2(gqa)
    block_m = verify_block_m(max_query_len, gqa)
    head_pad = triton.next_power_of_2(head_size)
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, query.device)
    if block_n is None:
        block_n = decode_block_n(query.dtype, head_size, num_splits)
    launch = pdl_launch_args(query.device)
    common = dict(GQA=gqa, GQA_PAD=gqa_pad, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=kv_cache.shape[2],
                  HEAD_SIZE=head_size, HEAD_PAD=head_pad, DOT_PRECISION=_dot_precision(query.dtype),
                  num_warps=num_warps, num_stages=num_stages, **launch)
    cache_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
                     block_table.stride(0))
    args = (query, output)
    tail = (kv_cache, block_table, seq_lens, query_start_loc, scale * LOG2E)
    if num_splits == 1:
        _verify_kernel[(num_kv_heads, num_seqs, 1)](
            *args, output, output, *tail, 1, query.stride(0), query.stride(1), output.stride(0), output.stride(1),
            *cache_strides, 0, 0, 0, 0, 0, SINGLE_SPLIT=True, **common)
        return output
    part_out, part_lse, part_strides = split_kv_partials(workspace, num_tokens, num_heads, num_splits, head_pad,
                                                         query.device)
    _verify_kernel[(num_kv_heads, num_seqs, num_splits)](
        *args, part_out, part_lse, *tail, num_splits, query.stride(0), query.stride(1), output.stride(0),
        output.stride(1), *cache_strides, *part_strides, SINGLE_SPLIT=False, **common)
    _verify_reduce_kernel[(num_seqs, num_heads, max_query_len)](
        output, part_out, part_lse, seq_lens, query_start_loc, num_splits,
        output.stride(0), output.stride(1), *part_strides,
        BLOCK_N=block_n, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4 if head_pad >= 128 else 2, **launch)
    return output
