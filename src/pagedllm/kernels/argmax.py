"""Row-wise argmax over a wide last dimension (greedy sampling from logits), Triton, for few rows.

torch.argmax gives one row to one thread block, so a batch-1 decode step reads 128k-256k logits with a single
SM, leaving the rest of the GPU idle (docs/benchmarks.md, run T). Here each row is cut into chunks read by many
programs; a second kernel merges the chunk winners. The result equals torch.argmax: the first index of the
maximum, and NaN counts as the maximum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.paged_attention import sm_count
from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel
from pagedllm.kernels.triton_launch import direct

_NONE = tl.constexpr(2147483647)  # index placeholder larger than any real one


@triton.jit(do_not_specialize=["n", "chunk", "num_parts"])
def _argmax_partial_kernel(x_ptr, stride_x, n, chunk, part_val_ptr, part_idx_ptr, num_parts,
                           BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_prior_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * chunk
    end = tl.minimum(start + chunk, n)
    offs = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], _NONE, tl.int32)
    for off in range(start, end, BLOCK):
        cols = off + offs
        ok = cols < end
        v = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)  # NaN wins, as in torch.argmax
        # Strictly greater keeps each lane's first maximum; the first visit of a lane always takes its value.
        take = ok & ((v > best_v) | (best_i == _NONE))
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, cols, best_i)
    top = tl.max(best_v, 0)
    idx = tl.min(tl.where(best_v == top, best_i, _NONE), 0)
    tl.store(part_val_ptr + row * num_parts + part, top)
    tl.store(part_idx_ptr + row * num_parts + part, idx)


@triton.jit(do_not_specialize=["num_parts"])
def _argmax_merge_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_parts, PARTS_PAD: tl.constexpr,
                         USE_PDL: tl.constexpr):
    wait_prior_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, PARTS_PAD)
    ok = p < num_parts
    v = tl.load(part_val_ptr + row * num_parts + p, mask=ok, other=float("-inf"))
    i = tl.load(part_idx_ptr + row * num_parts + p, mask=ok, other=_NONE)
    top = tl.max(v, 0)
    idx = tl.min(tl.where(ok & (v == top), i, _NONE), 0)
    tl.store(out_ptr + row, idx.to(tl.int64))


# Eager on every greedy step (the LM head's argmax outside the graphs): launched directly.
_argmax_partial, _argmax_merge = direct(_argmax_partial_kernel), direct(_argmax_merge_kernel)

# Rows up to this many use the split kernels; wider batches keep torch.argmax, which is already spread over rows.
MAX_SPLIT_ROWS = 32
_BLOCK = 1024
# Most chunks per row. The merge kernel always reads this many (masked), so one compiled variant serves every row
# count: a new variant would otherwise be compiled in the middle of a run when the batch shrinks.
_MAX_PARTS = 256


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, n] on CUDA -> int64 [rows], equal to x.argmax(-1)."""
    rows, n = x.shape
    if rows == 0 or rows > MAX_SPLIT_ROWS or n == 0 or x.stride(-1) != 1 or n >= 2 ** 31 - 1:
        return x.argmax(dim=-1)
    sm = sm_count(x.device)
    # About two programs per SM over all rows, each reading whole BLOCKs.
    parts = max(1, min(triton.cdiv(n, 4 * _BLOCK), triton.cdiv(2 * sm, rows), _MAX_PARTS))
    chunk = triton.cdiv(triton.cdiv(n, parts), _BLOCK) * _BLOCK
    parts = triton.cdiv(n, chunk)
    part_val = torch.empty(rows, parts, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows, parts, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    launch = pdl_launch_args(x.device)
    _argmax_partial[(rows, parts)](x, x.stride(0), n, chunk, part_val, part_idx, parts,
                                   BLOCK=_BLOCK, num_warps=4, **launch)
    _argmax_merge[(rows,)](part_val, part_idx, out, parts, PARTS_PAD=_MAX_PARTS, num_warps=1, **launch)
    return out
