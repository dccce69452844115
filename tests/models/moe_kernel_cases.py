"""Cases for the fused MoE Triton kernels against their torch references, shared by the CPU run in Triton's
interpreter (tests/models/interpret_fused_moe.py, fp32) and the GPU tests (tests/gpu/test_fused_moe_gpu.py).
Not a test module."""
from __future__ import annotations

import torch

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
             torch.float16: dict(atol=5e-3, rtol=5e-3)}


def make_case(tokens: int, experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str, seed: int = 0):
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], router logits [T, E]; outputs of order one. Each token's logits are
    a permutation of evenly spaced values (spacing above a bf16 ulp): no ties, so the top-k is unambiguous in every
    dtype."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    ranks = torch.argsort(torch.rand(tokens, experts, generator=g), dim=-1).float()
    logits = (ranks - experts / 2) * (6.0 / experts)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, w13, w2, logits))


def check_route(tokens: int, experts: int, top_k: int, renormalize: bool, dtype: torch.dtype, device: str,
                seed: int = 0) -> None:
    from pagedllm.kernels.fused_moe import moe_route, moe_route_ref

    logits = make_case(tokens, experts, 8, 8, dtype, device, seed)[3]
    weights, ids = moe_route(logits, top_k, renormalize)
    ref_w, ref_ids = moe_route_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), ref_ids.cpu()), (ids, ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_w.cpu(), atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(tokens), atol=1e-6, rtol=0)


def check_align(tokens: int, experts: int, top_k: int, block_m: int, device: str, seed: int = 0,
                skew: bool = False) -> None:
    """The device-side sort + align equals the reference exactly (stable order, padding, block owners), and the
    buffers have the static worst-case sizes a CUDA graph needs."""
    from pagedllm.kernels.fused_moe import max_padded_rows, moe_align_block_size, moe_align_block_size_ref

    g = torch.Generator().manual_seed(seed)
    if skew:  # most assignments to two experts, several experts unused
        ids = torch.randint(0, 2, (tokens, top_k), generator=g)
        ids[:, 0] = torch.randint(0, experts, (tokens,), generator=g) // 3
    else:
        ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    ids = ids.to(torch.int32)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids.to(device), experts, block_m)
    ref_sorted, ref_experts, ref_num = moe_align_block_size_ref(ids, experts, block_m)
    m = tokens * top_k
    assert sorted_ids.numel() == max_padded_rows(m, experts, block_m)
    assert int(num_post.item()) == ref_num
    assert torch.equal(sorted_ids[:ref_num].cpu(), ref_sorted)
    assert torch.equal(expert_ids[:ref_num // block_m].cpu(), ref_experts)


def check_fused(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, device: str,
                path=None, seed: int = 0, config=None) -> None:
    """Routing + both expert kernels against the reference; the reference against a per-token float64
    computation (so the reference itself cannot be wrong in the same way as the kernels)."""
    from pagedllm.kernels.fused_moe import fused_moe, fused_moe_ref, moe_route

    x, w13, w2, logits = make_case(tokens, experts, hidden, inter, dtype, device, seed)
    weights, ids = moe_route(logits, top_k, renormalize=True)
    out = fused_moe(x, w13, w2, weights, ids, path=path, config=config)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **TOLERANCE[dtype])
    if tokens <= 8:
        dense = per_token_reference(x.double().cpu(), w13.double().cpu(), w2.double().cpu(), weights.cpu(),
                                    ids.cpu())
        torch.testing.assert_close(ref.double().cpu(), dense, **{k: 2 * v for k, v in TOLERANCE[dtype].items()})


def check_fused_routed(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                       device: str, renormalize: bool = True, path=None, seed: int = 0, config=None) -> None:
    """The layer from the router logits (`fused_moe_routed`: on the GEMV path the routing runs inside the gate_up
    kernel) equals the reference routing followed by the reference experts. (Not bit for bit what `moe_route`
    then `fused_moe` give: the softmax's sums reduce in another order with another warp count.)"""
    from pagedllm.kernels.fused_moe import fused_moe_ref, fused_moe_routed, moe_route_ref

    x, w13, w2, logits = make_case(tokens, experts, hidden, inter, dtype, device, seed)
    out = fused_moe_routed(x, logits, w13, w2, top_k, renormalize, path=path, config=config)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    ref_w, ref_ids = moe_route_ref(logits, top_k, renormalize)
    ref = fused_moe_ref(x, w13, w2, ref_w, ref_ids)
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **TOLERANCE[dtype])


def check_fenced_equals_loops(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                              device: str, fenced: tuple, seed: int = 0) -> None:
    """The GEMV path's fenced kernels (fused_moe.FENCED_GEMV: a program's whole weight tile loaded before its
    products) give the K-step loops' outputs and routing bit for bit; `fenced` says which of (gate_up, down) the
    shapes and the dtype put on them, as gemv_plan must pick."""
    from pagedllm.kernels import fused_moe as fm

    x, w13, w2, logits = make_case(tokens, experts, hidden, inter, dtype, device, seed)
    default, outs = fm.FENCED_GEMV, {}
    try:
        for on in (False, True):
            fm.FENCED_GEMV = on
            gate, down = fm.gemv_plan(tokens, hidden, inter, top_k, weight_bytes=w13.element_size())
            assert (gate["FENCED"], down["FENCED"]) == (fenced if on else (False, False)), (gate, down)
            outs[on] = fm.fused_moe_routed(x, logits, w13, w2, top_k, True, path="gemv")
    finally:
        fm.FENCED_GEMV = default
    assert torch.equal(outs[True], outs[False]), (outs[True] - outs[False]).abs().max()


def make_block(experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, device: str, seed: int = 0):
    """models/moe.SparseMoeBlock (router + experts) and the RMSNorm before it, random weights (weights of order
    one: router logits spread over a few units)."""
    import types

    from pagedllm.layers.layernorm import RMSNorm
    from pagedllm.models.moe import MoESpec, SparseMoeBlock

    g = torch.Generator().manual_seed(seed)
    config = types.SimpleNamespace(hidden_size=hidden, hidden_act="silu")
    block = SparseMoeBlock(config, MoESpec(num_experts=experts, top_k=top_k, intermediate_size=inter,
                                           renormalize=True), "model.layers.0.mlp")
    norm = RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(experts, hidden, generator=g) / hidden ** 0.5 * 3)
        block.experts.gate_up_proj.copy_(torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5)
        block.experts.down_proj.copy_(torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5)
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
    return block.to(device=device, dtype=dtype), norm.to(device=device, dtype=dtype)


def check_norm_router(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                      device: str, seed: int = 0) -> None:
    """The MoE router's logits computed by the post-attention norm's kernel (SparseMoeBlock.norm_and_shrink, what
    RMSNorm calls on CUDA) against the norm alone then the router's own GEMV: the same normed rows and residual,
    the logits within rounding, the same experts picked, the block's output as close as the routing allows."""
    from pagedllm.models import moe

    block, norm = make_block(experts, top_k, hidden, inter, dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    fused = block.norm_and_shrink(norm, x, residual)
    assert fused is not None, "the router was not fused into the norm"
    out, new_residual = fused
    logits = block._pending[1]
    got = block(out)
    assert block._pending is None  # taken by forward
    ref_out, ref_residual = norm.forward_native(x, residual)
    ref_logits = block.gate(ref_out)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), ref_out.float().cpu(), **tol)
    torch.testing.assert_close(new_residual.float().cpu(), ref_residual.float().cpu(), **tol)
    assert logits.dtype == dtype and logits.shape == (tokens, experts)
    torch.testing.assert_close(logits.float().cpu(), ref_logits.float().cpu(), **tol)
    # The same experts, except where two logits sit within rounding of each other at the top-k boundary (a
    # different summation order may then pick the other one): compare the outputs of the tokens routed alike.
    lf, rf = logits.float().cpu(), ref_logits.float().cpu()
    picked = torch.topk(lf, top_k, dim=-1).indices.sort(-1).values
    ref_picked = torch.topk(rf, top_k, dim=-1).indices.sort(-1).values
    alike = (picked == ref_picked).all(-1)
    kth = torch.topk(rf, top_k, dim=-1).values[:, -1:]
    for t in torch.nonzero(~alike).flatten().tolist():
        swapped = sorted(set(picked[t].tolist()) ^ set(ref_picked[t].tolist()))
        near = (rf[t, swapped] - kth[t]).abs() <= tol["atol"] + tol["rtol"] * kth[t].abs()
        assert near.all(), (t, swapped, rf[t, swapped], kth[t])
    assert alike.float().mean() >= 0.5, alike
    torch.testing.assert_close(got.float().cpu()[alike], block(ref_out).float().cpu()[alike], **tol)
    # Outside its conditions (more rows than NORM_ROUTER_MAX_ROWS, or switched off) the norm runs alone.
    many = torch.randn(moe.NORM_ROUTER_MAX_ROWS + 1, hidden, generator=g).to(device=device, dtype=dtype)
    assert block.norm_and_shrink(norm, many, None) is None
    default, moe.NORM_ROUTER = moe.NORM_ROUTER, False
    try:
        assert block.norm_and_shrink(norm, x, residual) is None
    finally:
        moe.NORM_ROUTER = default


def per_token_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """sum_j w_j * down_e(silu(gate_e x) * up_e x), token by token, in x's dtype."""
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ x[t]
            out[t] += float(weights[t, j]) * (w2[e] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    return out
