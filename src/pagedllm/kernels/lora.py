"""Batched multi-LoRA shrink / expand (Punica SGMV style) in Triton, and their torch references.

One step's tokens may use different adapters. Adapter weights live in device slots:
  A [num_slots, n_slices * R, K]   (R = rank padded to a power of two >= 16; padding rows are zero)
  B [num_slots, R, N_total]        (R-major so a tile of B is contiguous along the output)
and the tokens are described by the step's slot metadata:
  sorted_token_ids [T] int32       token indices grouped by slot (tokens without an adapter are left out)
  slot_starts [num_slots + 1]      slot s owns sorted_token_ids[slot_starts[s]:slot_starts[s + 1]]

shrink:  h[split, t, :] = partial sums of x[t] @ A[slot(t)]^T        fp32, [SPLIT_K, T, n_slices * R]
expand:  out[t, off_j:off_j + n_j] += (sum_split h[:, t, j*R:(j+1)*R]) @ B[slot(t), :, off_j:off_j + n_j]

Each slot's segment is cut into row blocks of its own, numbered across slots (at most cdiv(T, BLOCK_M) + S
blocks; a grid with a slot axis instead launched S times the programs, nearly all of them empty at prefill sizes):
a program finds its slot and rows from the segment bounds in device memory and exits past the last block, so the
grids depend only on T and the shapes, and a captured CUDA graph replays any mix of adapters. The shrink splits K
across programs (a decode step has few tokens, and one program per token block would read all of A alone);
each split writes its own partial sums, which the expand adds up, so there is no atomic and no memset.

Steps of a few rows (decode, verify: <= SHRINK_ROWS_MAX tokens) use `lora_shrink_rows` / `lora_expand_rows`
instead: a program per (K slice or column block, token), reading the token's slot from `token_slots` [T] (-1: no
adapter), so A / B can be loaded before the PDL wait; the shrink's last split per token folds the partial sums
(a counter per token), and gate_up's expand applies the SiLU-and-mul. Measured in docs/benchmarks.md (Multi-LoRA).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel

BLOCK_M = 16


@triton.jit
def _slot_block(starts_ptr, pid_m, S, S_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block pid_m when each slot's segment of the sorted tokens is cut into BLOCK_M-row blocks of its own:
    (slot, first sorted position, end of the slot's segment); first == end past the last block."""
    s_idx = tl.arange(0, S_PAD)
    s_ok = s_idx < S
    lo = tl.load(starts_ptr + s_idx, mask=s_ok, other=0)
    hi = tl.load(starts_ptr + 1 + s_idx, mask=s_ok, other=0)
    nb = tl.where(s_ok, (hi - lo + BLOCK_M - 1) // BLOCK_M, 0)
    block_end = tl.cumsum(nb, 0)
    slot = tl.sum((block_end <= pid_m).to(tl.int32), 0)
    pick = s_idx == slot
    first = tl.sum(tl.where(pick, lo + (pid_m - (block_end - nb)) * BLOCK_M, 0), 0)
    end = tl.sum(tl.where(pick, hi, 0), 0)
    return slot, first, end


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, sorted_ptr, starts_ptr, N, K, K_PER_SPLIT, S,
                   stride_xm, stride_as, stride_an, stride_hs, stride_hm,
                   S_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row block of one slot, K split)."""
    wait_prior_kernel(USE_PDL)
    split = tl.program_id(1)
    slot, first, end = _slot_block(starts_ptr, tl.program_id(0), S, S_PAD, BLOCK_M)
    if first < end:
        offs_m = first + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        tok = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        k_lo = split * K_PER_SPLIT
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = (offs_k < K) & (offs_k < k_lo + K_PER_SPLIT)
                xb = tl.load(x_ptr + tok[:, None] * stride_xm + offs_k[None, :],
                             mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                ab = tl.load(a_ptr + slot.to(tl.int64) * stride_as + offs_n[None, :] * stride_an + offs_k[:, None],
                             mask=mask_n[None, :] & mask_k[:, None], other=0.0)
                if IEEE:
                    acc += tl.dot(xb, ab, input_precision="ieee")
                else:
                    acc += tl.dot(xb, ab)
            tl.store(h_ptr + split * stride_hs + tok[:, None] * stride_hm + offs_n[None, :], acc,
                     mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, out_ptr, sorted_ptr, starts_ptr, off0, off1, off2, size0, size1, size2, S,
                   stride_hs, stride_hm, stride_bs, stride_br, stride_om,
                   SPLIT_K: tl.constexpr, R: tl.constexpr, S_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row block of one slot, column block, slice)."""
    wait_prior_kernel(USE_PDL)
    pid_n = tl.program_id(1)
    j = tl.program_id(2)
    off = tl.where(j == 0, off0, tl.where(j == 1, off1, off2))
    size = tl.where(j == 0, size0, tl.where(j == 1, size1, size2))
    n0 = pid_n * BLOCK_N
    slot, first, end = _slot_block(starts_ptr, tl.program_id(0), S, S_PAD, BLOCK_M)
    if (first < end) & (n0 < size):
        offs_m = first + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        tok = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_r = tl.arange(0, R)
        hs = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for s in range(SPLIT_K):
            hs += tl.load(h_ptr + s * stride_hs + tok[:, None] * stride_hm + j * R + offs_r[None, :],
                          mask=mask_m[:, None], other=0.0)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < size
        bb = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br + off + offs_n[None, :],
                     mask=mask_n[None, :], other=0.0)
        if IEEE:
            delta = tl.dot(hs, bb.to(tl.float32), input_precision="ieee")
        else:
            delta = tl.dot(hs.to(bb.dtype), bb)
        out_ptrs = out_ptr + tok[:, None] * stride_om + off + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        cur = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (cur + delta).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_partial_and_fold(part, part_ptr, index, stride_part, row_off, offs, ok, h_row_ptr, counter_ptr,
                           NUM: tl.constexpr, PAD: tl.constexpr):
    """Store one program's partial sums of a row (part_ptr + index * stride_part + row_off + offs) and count it in the
    row's counter: the last of the row's NUM programs adds the NUM partials up in index order into h_row_ptr + offs
    (the same sum whatever order they finished in) and resets the counter for the next kernel."""
    tl.store(part_ptr + index * stride_part + row_off + offs, part, mask=ok)
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if done == NUM - 1:
        acc = tl.zeros((PAD,), dtype=tl.float32)
        for i in range(NUM):
            acc += tl.load(part_ptr + i * stride_part + row_off + offs, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(h_row_ptr + offs, acc, mask=ok)
        tl.atomic_xchg(counter_ptr, 0)


@triton.jit
def _shrink_rows_kernel(x_ptr, a_ptr, slot_ptr, part_ptr, h_ptr, counter_ptr, NR, K,
                        stride_xm, stride_as, stride_an, stride_ps, stride_pm, stride_hm,
                        KS: tl.constexpr, NR_PAD: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (split, t): token t's partial shrink over K slice `split`, A's slice loaded before the PDL wait (the
    slot table and A are written before the forward starts); the last program of t to finish (a counter per
    token, reset by that program) adds the partials up in split order into h[t]."""
    split = tl.program_id(0)
    t = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    offs_n = tl.arange(0, NR_PAD)
    offs_k = split * KS + tl.arange(0, KS)
    n_ok = offs_n < NR
    k_ok = offs_k < K
    a = tl.load(a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_as + offs_n[:, None] * stride_an + offs_k[None, :],
                mask=n_ok[:, None] & k_ok[None, :] & (slot >= 0), other=0.0)
    wait_prior_kernel(USE_PDL)
    if slot >= 0:
        x = tl.load(x_ptr + t * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        part = tl.sum(a.to(tl.float32) * x[None, :], axis=1)
        store_partial_and_fold(part, part_ptr, split, stride_ps, t * stride_pm, offs_n, n_ok, h_ptr + t * stride_hm,
                               counter_ptr + t, SPLIT, NR_PAD)


# Most tokens for lora_shrink_rows (a decode step's few rows); a counter per token.
SHRINK_ROWS_MAX = 16
# A elements per program of lora_shrink_rows (registers).
_ROWS_A_TILE = 8192


def lora_shrink_rows(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, counters: torch.Tensor
                     ) -> torch.Tensor:
    """The shrink of a few tokens (<= SHRINK_ROWS_MAX), summed: x [T, K], a [S, NR, K], token_slots [>= T] (-1: none),
    counters [>= T] int32 zeros (left zero) -> h [1, T, NR] fp32 (rows without an adapter unset)."""
    num_tokens, k = x.shape
    nr = a.shape[1]
    assert num_tokens <= SHRINK_ROWS_MAX and counters.numel() >= num_tokens and x.stride(-1) == 1
    assert a.is_contiguous() and a.shape[2] == k, (a.shape, x.shape)
    nr_pad = max(16, triton.next_power_of_2(nr))
    ks = max(16, min(triton.next_power_of_2(triton.cdiv(k, 32)), _ROWS_A_TILE // nr_pad))
    split = triton.cdiv(k, ks)
    part = torch.empty((split, num_tokens, nr), dtype=torch.float32, device=x.device)
    h = torch.empty((1, num_tokens, nr), dtype=torch.float32, device=x.device)
    if num_tokens:
        _shrink_rows_kernel[(split, num_tokens)](
            x, a, token_slots, part, h, counters, nr, k, x.stride(0), a.stride(0), a.stride(1), part.stride(0),
            part.stride(1), h.stride(1), KS=ks, NR_PAD=nr_pad, SPLIT=split, num_warps=4,
            **pdl_launch_args(x.device))
    return h


@triton.jit
def _expand_rows_kernel(h_ptr, b_ptr, out_ptr, act_ptr, slot_ptr, N, s1, s2,
                        stride_hs, stride_hm, stride_bs, stride_br, stride_om, stride_am,
                        R: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, SILU: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """Program (column block, t): out[t, cols] += h[t] @ B[slot(t)][:, cols], each column with its slice's h (slices
    start at columns s1, s2). SILU: out holds [gate; up] (N columns each); act[t, cols] = silu(gate + its delta)
    * (up + its delta), rounded as the unfused layers round. B is loaded before the PDL wait (the slot table and B
    are written before the forward starts)."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < N
    offs_r = tl.arange(0, R)
    slot = tl.load(slot_ptr + t)
    has = slot >= 0
    mask = (offs_r[:, None] < R) & c_ok[None, :] & has
    b_ptrs = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + offs_r[:, None] * stride_br + cols[None, :]
    b = tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        b_up = tl.load(b_ptrs + N, mask=mask, other=0.0).to(tl.float32)
        h_rows = offs_r[:, None] + 0 * cols[None, :]
    else:
        h_rows = ((cols >= s1).to(tl.int32) + (cols >= s2).to(tl.int32))[None, :] * R + offs_r[:, None]
    wait_prior_kernel(USE_PDL)
    h = tl.zeros((R, BLOCK_N), dtype=tl.float32)
    h_up = tl.zeros((R, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT):
        h += tl.load(h_ptr + s * stride_hs + t * stride_hm + h_rows, mask=mask, other=0.0)
        if SILU:
            h_up += tl.load(h_ptr + s * stride_hs + t * stride_hm + R + h_rows, mask=mask, other=0.0)
    out_ty = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + t * stride_om + cols
    if SILU:
        gate = (tl.load(out_ptrs, mask=c_ok, other=0.0).to(tl.float32) + tl.sum(b * h, axis=0)).to(out_ty)
        up = (tl.load(out_ptrs + N, mask=c_ok, other=0.0).to(tl.float32) + tl.sum(b_up * h_up, axis=0)).to(out_ty)
        g = gate.to(tl.float32)
        act = ((g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32) * up.to(tl.float32)).to(out_ty)
        tl.store(act_ptr + t * stride_am + cols, act, mask=c_ok)
    else:
        cur = tl.load(out_ptrs, mask=c_ok & has, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (cur + tl.sum(b * h, axis=0)).to(out_ty), mask=c_ok & has)


# Output columns per program of lora_expand_rows.
_EXPAND_ROWS_BLOCK_N = 128


def lora_expand_rows(h: torch.Tensor, b: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor,
                     slice_starts: tuple[int, ...] = (), silu: bool = False) -> Optional[torch.Tensor]:
    """The expand of a few tokens (<= SHRINK_ROWS_MAX): h [SPLIT, >= T, n_slices * R] fp32, b [S, R, N_total],
    out [T, N_total], token_slots [>= T] (-1: none). Adds each token's delta to out in place (slices start at
    `slice_starts`), or with `silu` (out = [gate; up], 2 slices of N_total / 2) returns silu(gate') * up' [T, N/2]
    of the adapted gate' and up' (out is left as it was)."""
    num_tokens, n_total = out.shape
    split, _, nr = h.shape
    r = b.shape[1]
    assert num_tokens <= SHRINK_ROWS_MAX and b.is_contiguous() and b.shape[2] == n_total and out.stride(-1) == 1
    n = n_total // 2 if silu else n_total
    starts = [n] if silu else list(slice_starts)
    assert nr == (len(starts) + 1) * r and len(starts) <= 2 and h.stride(-1) == 1, (h.shape, b.shape, starts)
    starts += [n_total] * (2 - len(starts))
    act = torch.empty((num_tokens, n), dtype=out.dtype, device=out.device) if silu else out
    if num_tokens:
        _expand_rows_kernel[(triton.cdiv(n, _EXPAND_ROWS_BLOCK_N), num_tokens)](
            h, b, out, act, token_slots, n, starts[0], starts[1], h.stride(0), h.stride(1), b.stride(0), b.stride(1),
            out.stride(0), act.stride(0), R=r, SPLIT=split, BLOCK_N=_EXPAND_ROWS_BLOCK_N, SILU=silu, num_warps=4,
            **pdl_launch_args(out.device))
    return act if silu else None


def shrink_split(num_tokens: int, k: int) -> int:
    """K splits of the shrink: enough programs to stream A fast for a few tokens, one for large batches (the expand
    adds the splits' partial sums up, so at most 16)."""
    blocks = triton.cdiv(max(num_tokens, 1), block_m(num_tokens))
    split = 1
    while blocks * split < 128 and k // (split * 2) >= 128 and split < 16:
        split *= 2
    return split


def block_m(num_tokens: int) -> int:
    """Sorted tokens per program of the general kernels: small blocks for decode-sized steps, larger ones for
    prefill-sized steps (fewer programs, each B / A tile reused by more rows)."""
    return BLOCK_M if num_tokens <= 1024 else 64


def lora_shrink(x: torch.Tensor, a: torch.Tensor, sorted_token_ids: torch.Tensor, slot_starts: torch.Tensor
                ) -> torch.Tensor:
    """x [T, K], a [S, NR, K] -> h [SPLIT_K, T, NR] fp32 (rows of tokens without an adapter are left unset)."""
    num_tokens, k = x.shape
    num_slots, nr, _ = a.shape
    assert x.stride(-1) == 1 and a.is_contiguous() and slot_starts.numel() == num_slots + 1
    split = shrink_split(num_tokens, k)
    h = torch.empty((split, num_tokens, nr), dtype=torch.float32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), 64) * 64
    block_n = min(256, max(16, triton.next_power_of_2(nr)))
    bm = block_m(num_tokens)
    grid = (triton.cdiv(num_tokens, bm) + num_slots, split)
    _shrink_kernel[grid](x, a, h, sorted_token_ids, slot_starts, nr, k, k_per_split, num_slots, x.stride(0),
                         a.stride(0), a.stride(1), h.stride(0), h.stride(1), S_PAD=triton.next_power_of_2(num_slots),
                         BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=64, IEEE=x.dtype == torch.float32, num_warps=4,
                         **pdl_launch_args(x.device))
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sorted_token_ids: torch.Tensor,
                slot_starts: torch.Tensor, slices: list[tuple[int, int]]) -> None:
    """out[t, off:off+n] += h(t, slice j) @ B[slot(t), :, off:off+n] for each slice (off, n); in place."""
    split, num_tokens, _ = h.shape
    num_slots, r, _ = b.shape
    assert 1 <= len(slices) <= 3 and out.stride(-1) == 1 and b.is_contiguous()
    assert slot_starts.numel() == num_slots + 1
    offs = [s[0] for s in slices] + [0] * (3 - len(slices))
    sizes = [s[1] for s in slices] + [0] * (3 - len(slices))
    block_n = 128 if max(sizes) >= 128 else max(16, triton.next_power_of_2(max(sizes)))
    bm = block_m(num_tokens)
    grid = (triton.cdiv(num_tokens, bm) + num_slots, triton.cdiv(max(sizes), block_n), len(slices))
    _expand_kernel[grid](h, b, out, sorted_token_ids, slot_starts, *offs, *sizes, num_slots, h.stride(0),
                         h.stride(1), b.stride(0), b.stride(1), out.stride(0), SPLIT_K=split,
                         R=r, S_PAD=triton.next_power_of_2(num_slots), BLOCK_M=bm, BLOCK_N=block_n,
                         IEEE=out.dtype == torch.float32, num_warps=4, **pdl_launch_args(out.device))


# ---- torch references (per token: the plainest statement of the math) ----------------------------------


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """[T, K], [S, NR, K], [T] (slot or -1) -> [T, NR] fp32 (zero rows for tokens without an adapter)."""
    h = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            h[t] = a[slot].float() @ x[t].float()
    return h


def lora_expand_ref(h: torch.Tensor, b: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor,
                    slices: list[tuple[int, int]]) -> torch.Tensor:
    """out + the delta, as a new fp32 tensor; h [T, n_slices * R], b [S, R, N_total]."""
    r = b.shape[1]
    res = out.float().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for j, (off, n) in enumerate(slices):
            res[t, off:off + n] += h[t, j * r:(j + 1) * r] @ b[slot, :, off:off + n].float()
    return res
