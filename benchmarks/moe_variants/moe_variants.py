"""Proposed variants of the MoE GEMV kernels at few tokens (kernels/fused_moe.py's math), from their sm_90 machine
code (moe_sass.py): the down GEMV with every expert's weight loads issued before its reductions (one round trip
instead of one per expert), the gate_up GEMV with the routing computed inside each warp (no block barriers before
the weights), the down GEMV routing for itself before the PDL wait. Timed by ab.py on a GPU before any of them goes
into src/."""
import triton
import triton.language as tl

from pagedllm.kernels.fused_moe import _gate_up_rows
from pagedllm.kernels.pdl import wait_prior_kernel


@triton.jit
def _top_k_of_row_warp(logits_ptr, t, stride_t, E, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                       RENORMALIZE: tl.constexpr, COPIES: tl.constexpr, CG: tl.constexpr):
    """_top_k_of_row on a [COPIES, E_PAD] tile (COPIES = num_warps): each warp holds the whole row and computes the
    routing redundantly, so every max / min / sum reduces inside a warp (shuffles, no shared memory, no barrier).
    Returns [COPIES, K_PAD] tensors (the rows are identical)."""
    experts = tl.arange(0, E_PAD)[None, :] + tl.zeros([COPIES, 1], dtype=tl.int32)
    ok = experts < E
    if CG:  # written two kernels back: read at L2, past any stale L1 line
        x = tl.load(logits_ptr + t * stride_t + experts, mask=ok, other=float("-inf"), cache_modifier=".cg")
    else:
        x = tl.load(logits_ptr + t * stride_t + experts, mask=ok, other=float("-inf"))
    x = x.to(tl.float32)
    p = tl.where(ok, tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(ok, p, -1.0)
    slots = tl.arange(0, K_PAD)[None, :] + tl.zeros([COPIES, 1], dtype=tl.int32)
    vals = tl.zeros([COPIES, K_PAD], dtype=tl.float32)
    idxs = tl.zeros([COPIES, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
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
def _route_in_warps(logits_ptr, ids_ptr, weights_ptr, m, stride_lt, E, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                    E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, COPIES: tl.constexpr):
    """Assignment m's (token, expert) from the router logits, routed inside each warp (_top_k_of_row_warp); the
    assignment's first program writes (expert, weight) for the down kernel, as _gemv_gate_up_kernel's ROUTE does."""
    token = (m // TOP_K).to(tl.int64)
    vals, idxs, slots = _top_k_of_row_warp(logits_ptr, token, stride_lt, E, TOP_K, K_PAD, E_PAD, RENORMALIZE,
                                           COPIES, False)
    mine = slots == m % TOP_K
    expert = tl.max(tl.sum(tl.where(mine, idxs, 0), axis=1), axis=0)  # (rows equal: the max is any)
    if tl.program_id(1) == 0:
        tl.store(ids_ptr + m, expert)
        tl.store(weights_ptr + m, tl.max(tl.sum(tl.where(mine, vals, 0.0), axis=1), axis=0))
    return token, expert.to(tl.int64)


@triton.jit
def gate_up_warp_route(x_ptr, w_ptr, ids_ptr, weights_ptr, logits_ptr, out_ptr, N, E,
                       stride_xm, stride_lt, stride_we, stride_wn, stride_om,
                       K: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                       ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                       COPIES: tl.constexpr = 4):
    """_gemv_gate_up_kernel with the routing reduced inside each warp (_top_k_of_row_warp)."""
    wait_prior_kernel(USE_PDL)
    m = tl.program_id(0)
    token, expert = _route_in_warps(logits_ptr, ids_ptr, weights_ptr, m, stride_lt, E, TOP_K, K_PAD, E_PAD,
                                    RENORMALIZE, COPIES)
    _gate_up_rows(x_ptr, w_ptr, out_ptr, m, token, expert, N, stride_xm, stride_we, stride_wn, stride_om, K, BLOCK_N,
                  BLOCK_K)


@triton.jit
def down_all_experts(a_ptr, w_ptr, ids_ptr, topk_w_ptr, out_ptr, N,
                     stride_am, stride_we, stride_wn, stride_om,
                     K: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """_gemv_down_sum_kernel with the token's k experts as one [K_PAD, BLOCK_N, BLOCK_K] tile: the k ids load
    together, every expert's weight loads issue before any is consumed, one reduction at the end (no barrier
    between experts). Same rounding: each expert's product x weight rounded, then the fp32 sum over experts."""
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
    w_base = w_ptr + experts[:, None, None] * stride_we + rows.to(tl.int64)[None, :, None] * stride_wn
    a_base = a_ptr + m[:, None] * stride_am
    acc = tl.zeros([K_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        col = k0 + cols
        col_ok = col < K
        a = tl.load(a_base + col[None, :], mask=s_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_base + col[None, None, :],
                    mask=s_ok[:, None, None] & row_ok[None, :, None] & col_ok[None, None, :], other=0.0,
                    eviction_policy="evict_first")
        acc += w.to(tl.float32) * a[:, None, :]
    out_ty = out_ptr.dtype.element_ty
    y = (tl.sum(acc, axis=2) * weights[:, None]).to(out_ty).to(tl.float32)  # [K_PAD, BLOCK_N]
    tl.store(out_ptr + t * stride_om + rows, tl.sum(y, axis=0).to(out_ty), mask=row_ok)


@triton.jit
def down_route_prefetch(a_ptr, w_ptr, logits_ptr, out_ptr, N, E, stride_lt,
                        stride_am, stride_we, stride_wn, stride_om,
                        K: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                        RENORMALIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_PDL: tl.constexpr, COPIES: tl.constexpr = 4):
    """down_all_experts with the token's routing recomputed from the router logits BEFORE the PDL wait (the
    logits come from the kernel before gate_up, complete by the time this kernel can start: it launches only after
    every gate_up program passed its own wait), so the expert weight loads issue before the wait, as the dense
    GEMV's do; only the activations are read after it. Single K step only (all of K in one tile)."""
    t = tl.program_id(0).to(tl.int64)
    vals, idxs, _ = _top_k_of_row_warp(logits_ptr, t, stride_lt, E, TOP_K, K_PAD, E_PAD, RENORMALIZE, COPIES, True)
    experts = tl.max(idxs, axis=0).to(tl.int64)  # [K_PAD] (rows equal)
    weights = tl.max(vals, axis=0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    slots = tl.arange(0, K_PAD)
    s_ok = slots < TOP_K
    m = t * TOP_K + slots
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    w = tl.load(w_ptr + experts[:, None, None] * stride_we + rows.to(tl.int64)[None, :, None] * stride_wn
                + cols[None, None, :], mask=s_ok[:, None, None] & row_ok[None, :, None] & col_ok[None, None, :],
                other=0.0, eviction_policy="evict_first")
    wait_prior_kernel(USE_PDL)
    a = tl.load(a_ptr + m[:, None] * stride_am + cols[None, :], mask=s_ok[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    y = (tl.sum(w.to(tl.float32) * a[:, None, :], axis=2) * weights[:, None]).to(out_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_om + rows, tl.sum(y, axis=0).to(out_ty), mask=row_ok)


@triton.jit
def down_all_fenced(a_ptr, w_ptr, ids_ptr, topk_w_ptr, out_ptr, N,
                    stride_am, stride_we, stride_wn, stride_om,
                    K: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """down_all_experts for K <= BLOCK_K (the whole row in one tile): the k experts' [BLOCK_N, K] weights in ONE
    load, then a CTA barrier (tl.debug_barrier) before any use, so that ptxas cannot sink the loads after the first
    FMAs: every weight byte of the program is requested before the first is consumed."""
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
    # The barrier keeps ptxas from interleaving the weight loads with the FMAs (it did, keeping 2-3 of 16 in
    # flight): the activations load after it, so no FMA can be scheduled above it, and no weight load below it.
    tl.debug_barrier()
    a = tl.load(a_ptr + m[:, None] * stride_am + cols[None, :], mask=s_ok[:, None] & col_ok[None, :], other=0.0)
    out_ty = out_ptr.dtype.element_ty
    y = (tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=2) * weights[:, None]).to(out_ty)
    tl.store(out_ptr + t * stride_om + rows, tl.sum(y.to(tl.float32), axis=0).to(out_ty), mask=row_ok)


@triton.jit
def gate_up_warp_route_fenced(x_ptr, w_ptr, ids_ptr, weights_ptr, logits_ptr, out_ptr, N, E,
                              stride_xm, stride_lt, stride_we, stride_wn, stride_om,
                              K: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                              ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                              COPIES: tl.constexpr = 4):
    """gate_up_warp_route for K == BLOCK_K: gate and up tiles in two loads, then a barrier before any use."""
    wait_prior_kernel(USE_PDL)
    m = tl.program_id(0)
    token, expert = _route_in_warps(logits_ptr, ids_ptr, weights_ptr, m, stride_lt, E, TOP_K, K_PAD, E_PAD,
                                    RENORMALIZE, COPIES)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    col = tl.arange(0, BLOCK_K)
    col_ok = col < K
    g_base = w_ptr + expert * stride_we + rows.to(tl.int64)[:, None] * stride_wn
    w_mask = row_ok[:, None] & col_ok[None, :]
    g = tl.load(g_base + col[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
    u = tl.load(g_base + N * stride_wn + col[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
    tl.debug_barrier()  # (as in down_all_fenced: x loads after it, so the FMAs cannot rise above the loads)
    x = tl.load(x_ptr + token * stride_xm + col, mask=col_ok, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    gate = tl.sum(g.to(tl.float32) * x[None, :], axis=1).to(out_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    y = act * tl.sum(u.to(tl.float32) * x[None, :], axis=1).to(out_ty).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + rows, y.to(out_ty), mask=row_ok)


@triton.jit
def down_chunks_fenced(a_ptr, w_ptr, ids_ptr, topk_w_ptr, out_ptr, N,
                       stride_am, stride_we, stride_wn, stride_om,
                       K: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """down_all_fenced with K in up to 4 chunks of BLOCK_K (768 = 3 x 256: no masked lanes, no idle warp), every
    chunk's load issued before the barrier (constexpr ifs: the chunks are separate tensors)."""
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
    w_ptrs = w_ptr + experts[:, None, None] * stride_we + rows.to(tl.int64)[None, :, None] * stride_wn \
        + cols[None, None, :]
    a_ptrs = a_ptr + m[:, None] * stride_am + cols[None, :]
    wm = s_ok[:, None, None] & row_ok[None, :, None]
    w0 = tl.load(w_ptrs, mask=wm & (cols < K)[None, None, :], other=0.0, eviction_policy="evict_first")
    if K > BLOCK_K:
        w1 = tl.load(w_ptrs + BLOCK_K, mask=wm & (cols + BLOCK_K < K)[None, None, :], other=0.0,
                     eviction_policy="evict_first")
    if K > 2 * BLOCK_K:
        w2 = tl.load(w_ptrs + 2 * BLOCK_K, mask=wm & (cols + 2 * BLOCK_K < K)[None, None, :], other=0.0,
                     eviction_policy="evict_first")
    if K > 3 * BLOCK_K:
        w3 = tl.load(w_ptrs + 3 * BLOCK_K, mask=wm & (cols + 3 * BLOCK_K < K)[None, None, :], other=0.0,
                     eviction_policy="evict_first")
    tl.debug_barrier()
    am = s_ok[:, None]
    acc = w0.to(tl.float32) * tl.load(a_ptrs, mask=am & (cols < K)[None, :], other=0.0).to(tl.float32)[:, None, :]
    if K > BLOCK_K:
        a1 = tl.load(a_ptrs + BLOCK_K, mask=am & (cols + BLOCK_K < K)[None, :], other=0.0).to(tl.float32)
        acc += w1.to(tl.float32) * a1[:, None, :]
    if K > 2 * BLOCK_K:
        a2 = tl.load(a_ptrs + 2 * BLOCK_K, mask=am & (cols + 2 * BLOCK_K < K)[None, :], other=0.0).to(tl.float32)
        acc += w2.to(tl.float32) * a2[:, None, :]
    if K > 3 * BLOCK_K:
        a3 = tl.load(a_ptrs + 3 * BLOCK_K, mask=am & (cols + 3 * BLOCK_K < K)[None, :], other=0.0).to(tl.float32)
        acc += w3.to(tl.float32) * a3[:, None, :]
    out_ty = out_ptr.dtype.element_ty
    y = (tl.sum(acc, axis=2) * weights[:, None]).to(out_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_om + rows, tl.sum(y, axis=0).to(out_ty), mask=row_ok)


def proposed_cases(gate_up_case, down_case):
    out = []
    # Qwen3 down: all experts at once, BLOCK_K 256 x 3 unrolled steps (768 = 3 x 256: no masked lanes) or 1024
    for bn in (2, 4):
        for bk in (256, 1024):
            out.append(down_case("qwen3-30b-a3b", 1, fn=down_all_experts, block_n=bn, block_k=bk, warps=4,
                                 tag="all-experts"))
    out.append(down_case("qwen3-30b-a3b", 1, fn=down_all_experts, block_n=8, block_k=256, warps=8,
                         tag="all-experts"))
    out.append(down_case("qwen3-30b-a3b", 2, fn=down_all_experts, block_n=4, block_k=256, warps=4,
                         tag="all-experts"))
    # Mixtral down with the same kernel (must not lose its ~44 KB per CTA in flight)
    for bn, bk, w in ((2, 2048, 8), (2, 1024, 4), (1, 2048, 4)):
        out.append(down_case("mixtral-8x7b", 1, fn=down_all_experts, block_n=bn, block_k=bk, warps=w,
                             tag="all-experts"))
    # gate_up: the routing inside each warp
    out.append(gate_up_case("qwen3-30b-a3b", 1, fn=gate_up_warp_route, tag="warp-route"))
    out.append(gate_up_case("qwen3-30b-a3b", 1, fn=gate_up_warp_route, block_n=8, warps=8, tag="warp-route",
                            extra=dict(COPIES=8)))
    out.append(gate_up_case("qwen3-30b-a3b", 1, block_n=8, warps=8, tag="launcher-kernel"))
    out.append(gate_up_case("mixtral-8x7b", 1, fn=gate_up_warp_route, tag="warp-route"))
    # fenced: one load group, then a barrier
    for bn, w in ((2, 4), (4, 4), (4, 8), (2, 2)):
        out.append(down_case("qwen3-30b-a3b", 1, fn=down_all_fenced, block_n=bn, block_k=1024, warps=w,
                             tag="all-fenced"))
    out.append(down_case("qwen3-30b-a3b", 2, fn=down_all_fenced, block_n=4, block_k=1024, warps=4, tag="all-fenced"))
    for bn, w in ((4, 4), (2, 4), (8, 8)):
        out.append(gate_up_case("qwen3-30b-a3b", 1, fn=gate_up_warp_route_fenced, block_n=bn, warps=w,
                                tag="warp-route-fenced", extra=dict(COPIES=w)))
    # down with the routing (and weight loads) before the PDL wait: one K step of 1024 (768 masked)
    for bn in (2, 4):
        name, fn, ints, const, warps, grid, wb = down_case("qwen3-30b-a3b", 1, fn=down_route_prefetch, block_n=bn,
                                                           block_k=1024, warps=4, tag="route-prefetch")
        ints.update(E=128, stride_lt=128)
        const.update(E_PAD=128, RENORMALIZE=True)
        out.append((name, fn, ints, const, warps, grid, wb))
    # down, K in chunks of 256 (768 = 3 x 256), every chunk's loads before the barrier
    for bn, w in ((2, 4), (4, 4), (4, 8), (2, 8)):
        out.append(down_case("qwen3-30b-a3b", 1, fn=down_chunks_fenced, block_n=bn, block_k=256, warps=w,
                             tag="chunks-fenced"))
    return out
