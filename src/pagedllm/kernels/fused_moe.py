"""Fused mixture-of-experts on CUDA (Triton) and the torch references its tests compare against.

Shapes: T tokens, H hidden, E experts, I intermediate size (per tensor-parallel rank), k experts per token,
M = T * k assignments (assignment m = t * k + j is token t's j-th expert).
  x [T, H]; w13 [E, 2I, H] (rows: gate then up); w2 [E, H, I]
  topk_weights float32 [T, k]; topk_ids int32 [T, k]

One layer is
  route       router logits [T, E] -> softmax (fp32) -> top-k -> optional renormalization    1 launch
  then, for few assignments (decode; M <= gemv_max_assignments: each picked expert is read once anyway),
    gemv gate_up + SiLU-and-mul   grid (M, I / BLOCK_N): act[m] = silu(x[t] @ W1[e]^T) * (x[t] @ W3[e]^T);
                                  `fused_moe_routed` computes the routing here too (no route launch)
    gemv down + sum               grid (T, H / BLOCK_N): out[t] = sum_j w[m] * (act[m] @ W2[e]^T), m = t * k + j
  or, for more (prefill, large batches: experts shared by many tokens),
    align       assignments sorted by expert, each expert's run padded to BLOCK_M       2 launches
    grouped gate_up + SiLU-and-mul   one launch over all experts' row blocks (tl.dot)
    grouped down + routing weight    one launch over all experts' row blocks
    out[t] = sum_j y[t * k + j]      (torch sum over [T, k, H])
  or, for large experts with ~512+ rows each (`torch_grouped_pays`: Mixtral's prefill), torch's grouped GEMM
  (CUTLASS) on the assignments gathered in expert order, silu_and_mul between, one weighted-sum pass after.

Everything is device-side with sizes fixed by T: the sorted-id buffer is allocated at its worst case
(M + E * (BLOCK_M - 1)), grids cover it, and programs whose row block lies past the padded total (read from
device memory) exit at once. No host sync, no data-dependent shape: a CUDA graph captures the whole layer.

Numerics (both paths, and `fused_moe_ref`): products summed in fp32; gate and up rounded to the activation dtype,
silu(gate) rounded, times up rounded (as `silu_and_mul` after a linear layer); the down product times the routing
weight in fp32, rounded once per assignment; the k rows summed in fp32 and rounded once. (The torch path rounds
the down product once more, before the weight.)
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, wait_prior_kernel


# ------------------------------------------------------------------------------------------------ routing

@triton.jit
def _top_k_of_row(logits_ptr, t, stride_t, E, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  RENORMALIZE: tl.constexpr):
    """Token t's routing: (weights [K_PAD] fp32, expert ids [K_PAD] int32, slots); slots >= TOP_K hold 0."""
    experts = tl.arange(0, E_PAD)
    ok = experts < E
    x = tl.load(logits_ptr + t * stride_t + experts, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.where(ok, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = p / tl.sum(p, axis=0)
    p = tl.where(ok, p, -1.0)  # below every probability: never picked
    slots = tl.arange(0, K_PAD)
    vals = tl.zeros([K_PAD], dtype=tl.float32)
    idxs = tl.zeros([K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):  # descending, as torch.topk; the lowest index among equal values
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, experts, E_PAD), axis=0)
        idx = tl.minimum(idx, E - 1)  # non-finite logits match nothing: never index past the experts
        vals = tl.where(slots == j, best, vals)
        idxs = tl.where(slots == j, idx, idxs)
        p = tl.where(experts == idx, -1.0, p)
    if RENORMALIZE:
        vals = vals / tl.sum(vals, axis=0)  # slots >= TOP_K hold 0
    return vals, idxs, slots


@triton.jit
def _top_k_of_row_warps(logits_ptr, t, stride_t, E, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                        RENORMALIZE: tl.constexpr, COPIES: tl.constexpr):
    """_top_k_of_row on a [COPIES, E_PAD] tile, COPIES = num_warps: every warp holds the whole row and routes it
    itself, so each max / min / sum reduces within a warp (shuffles: no shared memory, no CTA barrier before the
    weight loads). Returns [COPIES, K_PAD] tensors whose rows are equal."""
    experts = tl.arange(0, E_PAD)[None, :] + tl.zeros([COPIES, 1], dtype=tl.int32)
    ok = experts < E
    x = tl.load(logits_ptr + t * stride_t + experts, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.where(ok, tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(ok, p, -1.0)
    slots = tl.arange(0, K_PAD)[None, :] + tl.zeros([COPIES, 1], dtype=tl.int32)
    vals = tl.zeros([COPIES, K_PAD], dtype=tl.float32)
    idxs = tl.zeros([COPIES, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):  # as _top_k_of_row, per row
        best = tl.max(p, axis=1)[:, None]
        idx = tl.min(tl.where(p == best, experts, E_PAD), axis=1)[:, None]
        idx = tl.minimum(idx, E - 1)
        vals = tl.where(slots == j, best, vals)
        idxs = tl.where(slots == j, idx, idxs)
        p = tl.where(experts == idx, -1.0, p)
    if RENORMALIZE:
        vals = vals / tl.sum(vals, axis=1)[:, None]
    return vals, idxs, slots


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, stride_t, E,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                  USE_PDL: tl.constexpr):
    wait_prior_kernel(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    vals, idxs, slots = _top_k_of_row(logits_ptr, t, stride_t, E, TOP_K, K_PAD, E_PAD, RENORMALIZE)
    keep = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, vals, mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, idxs, mask=keep)


def _k_pad(top_k: int) -> int:
    """The slot axis of a token's top-k tiles (a power of two, >= 2)."""
    return max(2, triton.next_power_of_2(top_k))


def _route_meta(num_experts: int, top_k: int) -> dict:
    return dict(TOP_K=top_k, K_PAD=_k_pad(top_k),
                E_PAD=max(2, triton.next_power_of_2(num_experts)))


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any float dtype) -> (topk_weights float32 [T, k], topk_ids int32 [T, k])."""
    num_tokens, num_experts = router_logits.shape
    assert 1 <= top_k <= num_experts, (top_k, num_experts)
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            router_logits, weights, ids, router_logits.stride(0), num_experts, **_route_meta(num_experts, top_k),
            RENORMALIZE=renormalize, num_warps=1 if num_experts <= 64 else 2, **pdl_launch_args(weights.device))
    return weights, ids


def moe_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' routers (Mixtral, Qwen2/3-MoE): softmax in fp32, top-k, optional renormalization."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


# ------------------------------------------------------------------------------ sort by expert + align

@triton.jit(do_not_specialize=["M"])
def _align_count_kernel(ids_ptr, counts_ptr, M, ROWS: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """counts[p, e] = how many of program p's ROWS assignments go to expert e."""
    wait_prior_kernel(USE_PDL)
    p = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for s in range(0, ROWS, SUB):
        offs = p * ROWS + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < M, other=E_PAD)  # E_PAD matches no expert
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + p * E_PAD + experts, counts)


@triton.jit(do_not_specialize=["M", "P"])
def _align_place_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, M, E, P,
                        BLOCK_M: tl.constexpr, ROWS: tl.constexpr, SUB: tl.constexpr, P_SUB: tl.constexpr,
                        E_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    """Each program places its own assignments; program 0 also writes the padding, block owners and total.

    Expert e's run starts at pad_start[e] (the padded sizes of the experts before it); an assignment's place in
    the run is the number of earlier assignments (in index order) to the same expert: a stable sort."""
    wait_prior_kernel(USE_PDL)
    p = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    before = tl.zeros([E_PAD], dtype=tl.int32)  # this expert's assignments in programs before p
    for q0 in range(0, P, P_SUB):
        qs = q0 + tl.arange(0, P_SUB)
        c = tl.load(counts_ptr + qs[:, None] * E_PAD + experts[None, :], mask=(qs < P)[:, None], other=0)
        total += tl.sum(c, axis=0)
        before += tl.sum(tl.where((qs < p)[:, None], c, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    running = pad_start + before
    for s in range(0, ROWS, SUB):
        offs = p * ROWS + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < M, other=E_PAD)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [SUB, E_PAD]
        earlier = tl.cumsum(onehot, axis=0) - onehot  # same-expert assignments before this one in the piece
        dest = tl.sum(onehot * (earlier + running[None, :]), axis=1)
        tl.store(sorted_ptr + dest, offs, mask=offs < M)
        running += tl.sum(onehot, axis=0)
    if p == 0:
        num_post = tl.sum(padded, axis=0)
        tl.store(num_post_ptr, num_post)
        # The padding slots of every run hold M (no assignment); they are disjoint from the slots placed above.
        lanes = tl.arange(0, BLOCK_M)
        pad_pos = (pad_start + total)[:, None] + lanes[None, :]
        tl.store(sorted_ptr + pad_pos, M, mask=lanes[None, :] < (padded - total)[:, None])
        # Block b belongs to the expert whose run covers it: the number of runs that end at or before it.
        ends = tl.where(experts < E, pad_end // BLOCK_M, 1 << 30)
        num_blocks = num_post // BLOCK_M
        for b0 in range(0, num_blocks, SUB):
            blocks = b0 + tl.arange(0, SUB)
            owner = tl.sum((ends[None, :] <= blocks[:, None]).to(tl.int32), axis=1)
            tl.store(expert_ids_ptr + blocks, owner, mask=blocks < num_blocks)


def max_padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """The sorted-id buffer's worst case: every expert's run rounded up to a block."""
    return num_assignments + num_experts * (block_m - 1)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Assignments grouped by expert, each expert's run padded to a multiple of `block_m`.

    -> sorted_ids int32 [max_padded_rows] (assignment indices, M in padding slots; entries past num_post are
       unset), expert_ids int32 [max_padded_rows / block_m] (the expert of each row block; unset past num_post),
       num_post int32 [1] (the padded total, on the device)."""
    flat = topk_ids.reshape(-1)
    if flat.dtype != torch.int32 or not flat.is_contiguous():
        flat = flat.to(torch.int32).contiguous()
    m = flat.numel()
    rows = max_padded_rows(m, num_experts, block_m)
    dev = flat.device
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(triton.cdiv(rows, block_m), dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = max(2, triton.next_power_of_2(num_experts))
    sub = max(16, min(1024, 8192 // e_pad))  # one [SUB, E_PAD] one-hot piece in registers
    per_program = max(sub, triton.next_power_of_2(triton.cdiv(max(m, 1), 128)))  # at most ~128 programs
    programs = max(1, triton.cdiv(m, per_program))
    counts = torch.empty((programs, e_pad), dtype=torch.int32, device=dev)
    launch = pdl_launch_args(dev)
    _align_count_kernel[(programs,)](flat, counts, m, ROWS=per_program, SUB=sub, E_PAD=e_pad, num_warps=4,
                                     **launch)
    _align_place_kernel[(programs,)](flat, counts, sorted_ids, expert_ids, num_post, m, num_experts, programs,
                                     BLOCK_M=block_m, ROWS=per_program, SUB=sub,
                                     P_SUB=max(1, min(1024, 8192 // e_pad)), E_PAD=e_pad, num_warps=4, **launch)
    return sorted_ids, expert_ids, num_post


def moe_align_block_size_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
                             ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> (sorted_ids [num_post], expert_ids [num_post / block_m], num_post): a stable sort by expert, padded."""
    flat = topk_ids.reshape(-1).long()
    m = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.sort(flat, stable=True).indices
    num_post = int(padded.sum())
    sorted_ids = torch.full((num_post,), m, dtype=torch.int32)
    expert_ids = torch.empty(num_post // block_m, dtype=torch.int32)
    done = 0
    for e in range(num_experts):
        c = int(counts[e])
        s = int(starts[e])
        sorted_ids[s:s + c] = order[done:done + c].to(torch.int32)
        expert_ids[s // block_m:(s + int(padded[e])) // block_m] = e
        done += c
    return sorted_ids, expert_ids, num_post


# ------------------------------------------------------------------------------- few assignments: GEMV

# Where a program's weights fit one tile (gate_up: hidden <= BLOCK_K; down: intermediate <= BLOCK_K), the GEMVs
# load every weight of the program, then pass a CTA barrier, then load the activations and multiply: ptxas
# otherwise interleaves the loads with the products and keeps only a few in flight (sm_90 code:
# benchmarks/moe_variants/moe_sass.py). False: the K-step loops (the A/B: benchmarks/moe_variants/ab.py).
FENCED_GEMV = True
_FENCED_MAX_BYTES = 32768  # weights a fenced program holds in registers (16,384 16-bit values over 4 warps)


@triton.jit
def _gate_up_rows(x_ptr, w_ptr, out_ptr, m, token, expert, N, stride_xm, stride_we, stride_wn, stride_om,
                  K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FENCED: tl.constexpr = False):
    """act[m, rows] = silu(x[token] @ W1[expert]^T) * (x[token] @ W3[expert]^T) for this program's block of rows.
    FENCED (K <= BLOCK_K): both weight tiles loaded, then a CTA barrier, then x and the products (see FENCED_GEMV)."""
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    g_base = w_ptr + expert * stride_we + rows.to(tl.int64)[:, None] * stride_wn
    x_base = x_ptr + token * stride_xm
    if FENCED:
        col_ok = cols < K
        w_mask = row_ok[:, None] & col_ok[None, :]
        g = tl.load(g_base + cols[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        u = tl.load(g_base + N * stride_wn + cols[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        tl.debug_barrier()  # x loads below it: no product can be scheduled above the weight loads
        x = tl.load(x_base + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc_g = g.to(tl.float32) * x[None, :]
        acc_u = u.to(tl.float32) * x[None, :]
    else:
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: every step's loads can be in flight at once
            col = k0 + cols
            col_ok = col < K
            x = tl.load(x_base + col, mask=col_ok, other=0.0).to(tl.float32)
            w_mask = row_ok[:, None] & col_ok[None, :]
            g = tl.load(g_base + col[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
            u = tl.load(g_base + N * stride_wn + col[None, :], mask=w_mask, other=0.0,
                        eviction_policy="evict_first")
            acc_g += g.to(tl.float32) * x[None, :]
            acc_u += u.to(tl.float32) * x[None, :]
    out_ty = out_ptr.dtype.element_ty
    gate = tl.sum(acc_g, axis=1).to(out_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    y = act * tl.sum(acc_u, axis=1).to(out_ty).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + rows, y.to(out_ty), mask=row_ok)


@triton.jit
def _gemv_gate_up_kernel(x_ptr, w_ptr, ids_ptr, weights_ptr, logits_ptr, out_ptr, N, E,
                         stride_xm, stride_lt, stride_we, stride_wn, stride_om,
                         K: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                         ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                         COPIES: tl.constexpr = 4, FENCED: tl.constexpr = False):
    """act[m] = silu(x[t] @ W1[e]^T) * (x[t] @ W3[e]^T) for assignment m = t * TOP_K + j, rows of one block.
    ROUTE: e comes from the router logits (the routing computed here, by every warp of every program of the token: a
    few hundred flops; COPIES = num_warps), and each assignment's first program writes (e, weight) for the down
    kernel; else from ids."""
    wait_prior_kernel(USE_PDL)
    m = tl.program_id(0)
    token = (m // TOP_K).to(tl.int64)
    if ROUTE:
        vals, idxs, slots = _top_k_of_row_warps(logits_ptr, token, stride_lt, E, TOP_K, K_PAD, E_PAD, RENORMALIZE,
                                                COPIES)
        mine = slots == m % TOP_K
        expert = tl.max(tl.sum(tl.where(mine, idxs, 0), axis=1), axis=0)  # (the rows are equal: any of them)
        if tl.program_id(1) == 0:
            tl.store(ids_ptr + m, expert)
            tl.store(weights_ptr + m, tl.max(tl.sum(tl.where(mine, vals, 0.0), axis=1), axis=0))
        expert = expert.to(tl.int64)
    else:
        expert = tl.load(ids_ptr + m).to(tl.int64)
    _gate_up_rows(x_ptr, w_ptr, out_ptr, m, token, expert, N, stride_xm, stride_we, stride_wn, stride_om, K, BLOCK_N,
                  BLOCK_K, FENCED)


@triton.jit
def _gemv_down_sum_kernel(a_ptr, w_ptr, ids_ptr, topk_w_ptr, out_ptr, N,
                          stride_am, stride_we, stride_wn, stride_om,
                          K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """out[t] = sum_j round(w[m] * (act[m] @ W2[e_m]^T)) over token t's assignments m = t * TOP_K + j: the down
    products and the sum over the k experts in one pass (no [T, k, H] intermediate, no separate sum)."""
    wait_prior_kernel(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    out_ty = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        m = t * TOP_K + j
        expert = tl.load(ids_ptr + m).to(tl.int64)
        weight = tl.load(topk_w_ptr + m)
        w_base = w_ptr + expert * stride_we + rows.to(tl.int64)[:, None] * stride_wn
        a_base = a_ptr + m * stride_am
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            col = k0 + cols
            col_ok = col < K
            a = tl.load(a_base + col, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_base + col[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
            acc += w.to(tl.float32) * a[None, :]
        total += (tl.sum(acc, axis=1) * weight).to(out_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_om + rows, total.to(out_ty), mask=row_ok)


@triton.jit
def _gemv_down_fenced_kernel(a_ptr, w_ptr, ids_ptr, topk_w_ptr, out_ptr, N,
                             stride_am, stride_we, stride_wn, stride_om,
                             K: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """_gemv_down_sum_kernel for K <= BLOCK_K (a whole row in one tile): the token's k experts' [BLOCK_N, K]
    weights in one [K_PAD, BLOCK_N, BLOCK_K] load, a CTA barrier, then the activations and the products, so every
    weight byte of the program is requested before the first is used (see FENCED_GEMV). The same rounding: each
    expert's product times its weight rounded, then the fp32 sum over the experts."""
    wait_prior_kernel(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    slots = tl.arange(0, K_PAD)
    s_ok = slots < TOP_K
    m = t * TOP_K + slots
    experts = tl.load(ids_ptr + m, mask=s_ok, other=0).to(tl.int64)
    weights = tl.load(topk_w_ptr + m, mask=s_ok, other=0.0)
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    w = tl.load(w_ptr + experts[:, None, None] * stride_we + rows.to(tl.int64)[None, :, None] * stride_wn
                + cols[None, None, :], mask=s_ok[:, None, None] & row_ok[None, :, None] & col_ok[None, None, :],
                other=0.0, eviction_policy="evict_first")
    tl.debug_barrier()  # the activations load below it: no product can be scheduled above a weight load
    a = tl.load(a_ptr + m[:, None] * stride_am + cols[None, :], mask=s_ok[:, None] & col_ok[None, :], other=0.0)
    out_ty = out_ptr.dtype.element_ty
    y = (tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=2) * weights[:, None]).to(out_ty)
    tl.store(out_ptr + t * stride_om + rows, tl.sum(y.to(tl.float32), axis=0).to(out_ty), mask=row_ok)


def _gemv_k_step(k: int) -> int:
    """BLOCK_K of both GEMV kernels: K steps of up to 2048 columns (a whole Qwen3-MoE row; the H200 sweeps of
    benchmarks/moe.py)."""
    return min(2048, max(16, triton.next_power_of_2(k)))


def _gemv_gate_up_blocks(k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the gate_up kernel: 2-4 rows of gate and of up per program (16k weight elements in
    flight)."""
    block_k = _gemv_k_step(k)
    return max(2, min(4, 8192 // block_k)), block_k


# -------------------------------------------------------------------- many assignments: grouped GEMM

@triton.jit
def _block_coords(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped program order: GROUP_M row blocks share each column tile while it is in L2."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M", "TOP_K", "num_pid_m"])
def _grouped_gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                            M, N, K, TOP_K, num_pid_m,
                            stride_xm, stride_we, stride_wn, stride_om,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    wait_prior_kernel(USE_PDL)
    pid_m, pid_n = _block_coords(num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # assignment ids, M = padding
    row_ok = rows < M
    tokens = (rows // TOP_K).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    out_ty = out_ptr.dtype.element_ty
    gate = acc_g.to(out_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    y = act * acc_u.to(out_ty).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :], y.to(out_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M", "num_pid_m"])
def _grouped_down_kernel(a_ptr, w_ptr, topk_w_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                         M, N, K, num_pid_m,
                         stride_am, stride_we, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    wait_prior_kernel(USE_PDL)
    pid_m, pid_n = _block_coords(num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    weight = tl.load(topk_w_ptr + rows64, mask=row_ok, other=0.0)
    y = acc * weight[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


def grouped_config(num_assignments: int, num_experts: int, dtype: torch.dtype, inter: int = 0) -> dict:
    """Tile sizes by how many rows an expert gets on average (GATE_BLOCK_N: the gate_up kernel holds two
    accumulators, gate and up); inter, the down projection's K, widens its tiles where K is short."""
    per_expert = num_assignments / num_experts
    if dtype == torch.float32:  # fp32 (tests, references): FMA dots, smaller tiles
        return dict(BLOCK_M=16 if per_expert <= 16 else 32, BLOCK_N=64, GATE_BLOCK_N=32, BLOCK_K=32, GROUP_M=8,
                    num_warps=4, num_stages=2)
    # The H200 sweeps of benchmarks/moe.py (Qwen3-30B-A3B and Mixtral shapes) chose these.
    if per_expert <= 8:
        return dict(BLOCK_M=16, BLOCK_N=64, GATE_BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    if per_expert <= 32:
        return dict(BLOCK_M=32, BLOCK_N=128, GATE_BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    if per_expert <= 128:
        return dict(BLOCK_M=64, BLOCK_N=128, GATE_BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
    # prefill-sized groups: the large tiles, 8 warps, a deeper pipeline; a short down K (Qwen3-MoE's 768) has few
    # steps to hide each tile's start behind, so its tiles span more of N
    return dict(BLOCK_M=128, BLOCK_N=256 if 0 < inter <= 1024 else 128, GATE_BLOCK_N=128, BLOCK_K=64, GROUP_M=8,
                num_warps=8, num_stages=4)


# ------------------------------------------------------------------------------------------ the layer op

def gemv_max_assignments(num_experts: int, top_k: int) -> int:
    """Up to this many assignments the per-assignment GEMV path runs (few tokens, experts rarely shared): two
    tokens' worth at least (Mixtral at 2 tokens, 3 experts hit: the GEMV path beat the grouped one on the H200)."""
    return max(2 * top_k, num_experts // 8)


def _gemv_down_blocks(num_tokens: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the down-and-sum kernel: one program per (token, row block) walks all k
    experts, so the row blocks are narrow enough to give the SMs ~1024 programs; long rows take 8 warps."""
    block_k = _gemv_k_step(k)
    block_n = max(2, min(16, 4096 // block_k))
    while block_n > 2 and num_tokens * triton.cdiv(n, block_n) < 1024:
        block_n //= 2
    return block_n, block_k, 8 if k >= 4096 else 4


def gemv_plan(num_tokens: int, hidden: int, inter: int, top_k: int, config: Optional[dict] = None,
              weight_bytes: int = 2) -> tuple[dict, dict]:
    """The GEMV path's launch parameters: (gate_up's, down's) BLOCK_N / BLOCK_K / num_warps / FENCED, from the
    shapes, the weights' element size and the config's overrides (fused_moe's docstring)."""
    cfg = config or {}
    most = _FENCED_MAX_BYTES // weight_bytes  # weight elements of a fenced program
    block_n, block_k = _gemv_gate_up_blocks(hidden)
    block_n, block_k = cfg.get("GATE_BLOCK_N", block_n), cfg.get("GATE_BLOCK_K", block_k)
    gate = dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=cfg.get("GATE_num_warps", 4),
                FENCED=FENCED_GEMV and block_k >= hidden and 2 * block_n * block_k <= most)
    block_n, block_k, warps = _gemv_down_blocks(num_tokens, hidden, inter)
    block_n, block_k = cfg.get("BLOCK_N", block_n), cfg.get("BLOCK_K", block_k)
    k_pad = _k_pad(top_k)
    if FENCED_GEMV and block_k >= inter and "BLOCK_N" not in cfg:  # narrower rows: the tile fits the registers
        while block_n > 1 and k_pad * block_n * block_k > most:
            block_n //= 2
    down = dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=cfg.get("num_warps", warps),
                FENCED=FENCED_GEMV and block_k >= inter and k_pad * block_n * block_k <= most)
    return gate, down


def _check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int, int]:
    num_tokens, hidden = x.shape
    num_experts, two_i, k_w = w13.shape
    inter = two_i // 2
    assert k_w == hidden and w2.shape == (num_experts, hidden, inter), (x.shape, w13.shape, w2.shape)
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1
    return num_tokens, hidden, num_experts, inter


def _gemv_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, config: Optional[dict], router_logits: Optional[torch.Tensor] = None,
                  renormalize: bool = False) -> torch.Tensor:
    """Two launches: gate_up + SiLU-and-mul per assignment (with router_logits: the routing too, written into
    topk_weights / topk_ids), then down + routing weight + the sum over each token's k experts."""
    num_tokens, hidden, num_experts, inter = _check_shapes(x, w13, w2)
    top_k = topk_ids.shape[1]
    m = num_tokens * top_k
    launch = pdl_launch_args(x.device)
    act = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    route = router_logits is not None
    logits = router_logits if route else topk_weights  # an unused pointer when not routing
    meta = _route_meta(num_experts, top_k)
    gate, down = gemv_plan(num_tokens, hidden, inter, top_k, config, w13.element_size())
    _gemv_gate_up_kernel[(m, triton.cdiv(inter, gate["BLOCK_N"]))](
        x, w13, topk_ids, topk_weights, logits, act, inter, num_experts,
        x.stride(0), logits.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        K=hidden, **meta, ROUTE=route, RENORMALIZE=renormalize, COPIES=gate["num_warps"], **gate, **launch)
    args = (act, w2, topk_ids, topk_weights, out, hidden, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0))
    grid = (num_tokens, triton.cdiv(hidden, down["BLOCK_N"]))
    if down.pop("FENCED"):
        _gemv_down_fenced_kernel[grid](*args, K=inter, TOP_K=top_k, K_PAD=meta["K_PAD"], **down, **launch)
    else:
        _gemv_down_sum_kernel[grid](*args, K=inter, TOP_K=top_k, **down, **launch)
    return out


def _grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, config: Optional[dict]) -> torch.Tensor:
    num_tokens, hidden, num_experts, inter = _check_shapes(x, w13, w2)
    top_k = topk_ids.shape[1]
    m = num_tokens * top_k
    act = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((num_tokens, top_k, hidden), dtype=x.dtype, device=x.device)
    launch = pdl_launch_args(x.device)
    cfg = dict(grouped_config(m, num_experts, x.dtype, inter), **(config or {}))
    block_m = cfg["BLOCK_M"]
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, num_experts, block_m)
    num_pid_m = expert_ids.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = dict(BLOCK_M=block_m, BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], DOT_PRECISION=precision,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch)
    gate_bn = cfg["GATE_BLOCK_N"]
    _grouped_gate_up_kernel[(num_pid_m * triton.cdiv(inter, gate_bn),)](
        x, w13, act, sorted_ids, expert_ids, num_post, m, inter, hidden, top_k, num_pid_m,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), BLOCK_N=gate_bn, **common)
    down_bn = cfg["BLOCK_N"]
    _grouped_down_kernel[(num_pid_m * triton.cdiv(hidden, down_bn),)](
        act, w2, topk_weights, y, sorted_ids, expert_ids, num_post, m, hidden, inter, num_pid_m,
        act.stride(0), w2.stride(0), w2.stride(1), hidden, BLOCK_N=down_bn, **common)
    return y.sum(dim=1)


@triton.jit
def _combine_kernel(y_ptr, rows_ptr, topk_w_ptr, out_ptr, N, stride_y, stride_o,
                    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t] = sum_j round(w[m] * y[rows[m]]), m = t * TOP_K + j: each assignment's down product (in expert order,
    at row rows[m]) weighted and summed per token in one pass."""
    wait_prior_kernel(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    out_ty = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        m = t * TOP_K + j
        row = tl.load(rows_ptr + m)
        y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        total += (y * tl.load(topk_w_ptr + m)).to(out_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, total.to(out_ty), mask=ok)


def torch_grouped_pays(num_assignments: int, num_experts: int, inter: int, x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM (CUTLASS, sm90, bf16) beats the Triton grouped kernels: large experts with
    ~512+ rows each (Mixtral's prefill chunks; the H200 rows of benchmarks/moe.py). Elsewhere torch's version
    loses or falls back to a per-group loop that syncs with the host."""
    return (x.dtype == torch.bfloat16 and x.is_cuda and hasattr(torch, "_grouped_mm") and inter >= 4096
            and num_assignments >= 512 * num_experts and torch.cuda.get_device_capability(x.device) == (9, 0))


def _torch_grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts as two calls of torch's grouped GEMM over the assignments sorted by expert, the activation
    between them and the weighted sum over each token's k experts after (`_combine_kernel`). Device-side only."""
    from pagedllm.kernels.activation import silu_and_mul

    num_tokens, hidden, num_experts, inter = _check_shapes(x, w13, w2)
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    act = silu_and_mul(torch._grouped_mm(x.index_select(0, order // top_k), w13.transpose(1, 2), offs=offs))
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [M, H] in expert order
    rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    block_n = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        y, rows, topk_weights, out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK_N=block_n, num_warps=4,
        **pdl_launch_args(x.device))
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, path: Optional[str] = None, config: Optional[dict] = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights fp32 [T, k], topk_ids int32 [T, k] -> [T, H].

    path: "gemv" | "grouped" | "torch" (torch._grouped_mm) | None (by the assignment count); config: tile sizes
    for the path taken (benchmarks sweep them; gemv: GATE_BLOCK_N / GATE_BLOCK_K / GATE_num_warps of the gate_up
    kernel, BLOCK_N / BLOCK_K / num_warps of the down kernel)."""
    num_tokens, hidden, num_experts, inter = _check_shapes(x, w13, w2)
    top_k = topk_ids.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    topk_ids = topk_ids.to(torch.int32).contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    m = num_tokens * top_k
    if m == 0:
        return torch.zeros((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if path is None:
        path = ("gemv" if m <= gemv_max_assignments(num_experts, top_k) else
                "torch" if torch_grouped_pays(m, num_experts, inter, x) else "grouped")
    if path == "gemv":
        return _gemv_experts(x, w13, w2, topk_weights, topk_ids, config)
    if path == "grouped":
        return _grouped_experts(x, w13, w2, topk_weights, topk_ids, config)
    if path == "torch":
        return _torch_grouped_experts(x, w13, w2, topk_weights, topk_ids)
    raise ValueError(f"fused_moe path must be 'gemv', 'grouped', 'torch' or None, got {path!r}")


def fused_moe_routed(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     top_k: int, renormalize: bool, path: Optional[str] = None,
                     config: Optional[dict] = None) -> torch.Tensor:
    """The whole layer from the router logits [T, E]: on the GEMV path the routing runs inside the gate_up
    kernel (two launches in all), else `moe_route` first."""
    num_tokens, hidden, num_experts, inter = _check_shapes(x, w13, w2)
    assert router_logits.shape == (num_tokens, num_experts), (router_logits.shape, x.shape, num_experts)
    assert 1 <= top_k <= num_experts, (top_k, num_experts)
    m = num_tokens * top_k
    if path is None and 0 < m <= gemv_max_assignments(num_experts, top_k):
        path = "gemv"
    if path != "gemv" or m == 0:
        weights, ids = moe_route(router_logits, top_k, renormalize)
        return fused_moe(x, w13, w2, weights, ids, path=path, config=config)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=x.device)
    return _gemv_experts(x, w13, w2, weights, ids, config, router_logits=router_logits, renormalize=renormalize)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The plain statement (one expert at a time, fp32 products, the kernels' rounding points)."""
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    dt = x.dtype
    y = torch.zeros(num_tokens, top_k, hidden, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        gu = x[tok].float() @ w13[e].float().t()
        gate, up = gu[:, :inter].to(dt).float(), gu[:, inter:].to(dt).float()
        act = (torch.nn.functional.silu(gate).to(dt).float() * up).to(dt).float()
        out = (act @ w2[e].float().t()) * topk_weights[tok, slot].float()[:, None]
        y[tok, slot] = out.to(dt).float()
    return y.sum(dim=1).to(dt)
