"""Cases for the LoRA shrink/expand kernels against their torch references (shared by the CPU interpreter test
and the GPU tests). Not a test module.

`check_case` builds a batch of tokens spread over some slots (and tokens without an adapter), runs
kernels/lora.py and compares with lora_shrink_ref / lora_expand_ref and the engine's CPU path.
"""
from __future__ import annotations

import torch


def build_case(num_tokens: int, num_slots: int, k: int, slices: list[int], rank: int, max_rank: int,
               dtype: torch.dtype, device: str, seed: int = 0, none_frac: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    n_total = sum(slices)
    x = (torch.randn(num_tokens, k, generator=gen) * 0.5).to(dtype).to(device)
    a = torch.zeros(num_slots, len(slices) * max_rank, k)
    b = torch.zeros(num_slots, max_rank, n_total)
    for s in range(num_slots):
        for j in range(len(slices)):
            a[s, j * max_rank:j * max_rank + rank] = torch.randn(rank, k, generator=gen) * 0.1
        b[s, :rank] = torch.randn(rank, n_total, generator=gen) * 0.1
    a, b = a.to(dtype).to(device), b.to(dtype).to(device)
    slots = torch.randint(0, num_slots, (num_tokens,), generator=gen)
    slots[torch.rand(num_tokens, generator=gen) < none_frac] = -1
    spans, off = [], 0
    for n in slices:
        spans.append((off, n))
        off += n
    out = (torch.randn(num_tokens, n_total, generator=gen) * 0.5).to(dtype).to(device)
    return x, a, b, slots.to(torch.int32), spans, out


def step_metadata(token_slots: torch.Tensor, num_slots: int):
    """(sorted_token_ids, slot_starts) as the LoRA manager builds them."""
    order = torch.argsort(token_slots, stable=True)
    num_none = int((token_slots < 0).sum())
    counts = torch.bincount(token_slots[token_slots >= 0].long(), minlength=num_slots)
    starts = torch.zeros(num_slots + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(counts, 0)
    return order[num_none:].to(torch.int32), starts


def check_case(num_tokens, num_slots, k, slices, rank, max_rank, dtype, device, seed=0, none_frac=0.3,
               pad_rows: int = 0) -> None:
    from pagedllm.kernels import lora as kernels
    from pagedllm.lora.layers import batched_lora_delta

    x, a, b, slots, spans, out = build_case(num_tokens + pad_rows, num_slots, k, slices, rank, max_rank, dtype,
                                            device, seed, none_frac)
    slots[num_tokens:] = -1  # padding rows (a CUDA graph's bucket beyond the batch) never join a segment
    sorted_ids, starts = step_metadata(slots[:num_tokens], num_slots)
    ref_h = kernels.lora_shrink_ref(x.cpu(), a.cpu(), slots)
    h = kernels.lora_shrink(x, a, sorted_ids.to(device), starts.to(device))
    h_sum = h.sum(0).cpu()
    has = slots >= 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(h_sum[has], ref_h[has], atol=tol, rtol=tol)
    expected = kernels.lora_expand_ref(ref_h, b.cpu(), out.cpu(), slots, spans)
    got = out.clone()
    kernels.lora_expand(h, b, got, sorted_ids.to(device), starts.to(device), spans)
    torch.testing.assert_close(got.float().cpu(), expected, atol=tol * 4, rtol=tol)
    untouched = ~has
    assert torch.equal(got.cpu()[untouched], out.cpu()[untouched]), "rows without an adapter changed"
    if dtype == torch.float32:  # the CPU path agrees too
        cpu = out.cpu() + batched_lora_delta(x.cpu(), a.cpu(), b.cpu(), slots, spans)
        torch.testing.assert_close(cpu, expected, atol=1e-5, rtol=1e-5)


def _split_partials(h: torch.Tensor, split: int, seed: int) -> torch.Tensor:
    """[T, NR] -> [split, T, NR] random partial sums adding up to h (as a split-K shrink leaves them)."""
    gen = torch.Generator().manual_seed(seed)
    frac = torch.rand(split, *h.shape, generator=gen) + 0.1
    return h * (frac / frac.sum(0))


def check_norm_shrink_case(rows, num_slots, hidden, num_slices, rank, max_rank, dtype, device, residual=True,
                           fp32_product=False, seed=0) -> None:
    """kernels/norm.rms_norm_shrink: the norm (and new residual) equal rms_norm's, h the shrink of that output."""
    from pagedllm.kernels import norm
    from pagedllm.kernels.lora import lora_shrink_ref

    x, a, _, slots, _, res = build_case(rows, num_slots, hidden, [hidden] * num_slices, rank, max_rank, dtype, device,
                                        seed)
    res = res[:, :hidden].contiguous() if residual else None
    gen = torch.Generator().manual_seed(seed + 7)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.float32 if fp32_product else dtype).to(device)
    out, new_res, h = norm.rms_norm_shrink(x, res, weight, 1e-6, fp32_product, a, slots.to(device))
    if res is None:
        ref_out, ref_res = norm.rms_norm_ref(x.cpu(), weight.cpu(), 1e-6, fp32_product), None
    else:
        ref_out, ref_res = norm.fused_add_rms_norm_ref(x.cpu(), res.cpu(), weight.cpu(), 1e-6, fp32_product)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().float(), ref_out.float(), atol=tol, rtol=tol)
    if ref_res is None:
        assert new_res is None
    else:
        torch.testing.assert_close(new_res.cpu().float(), ref_res.float(), atol=tol, rtol=tol)
    assert h.shape == (1, rows, a.shape[1])
    ref_h = lora_shrink_ref(out.cpu(), a.cpu(), slots)  # of the norm's own (rounded) output, as the layer reads it
    torch.testing.assert_close(h[0].cpu(), ref_h, atol=tol * 5, rtol=tol * 5)
    assert torch.all(h[0].cpu()[slots < 0] == 0)


def check_shrink_rows_case(num_tokens, num_slots, k, num_slices, rank, max_rank, dtype, device, seed=0) -> None:
    """kernels/lora.lora_shrink_rows (few tokens, split-K, the last split folds): h equals the reference shrink,
    twice in a row (the per-token counters are left at zero for the next call)."""
    from pagedllm.kernels import lora as kernels

    x, a, _, slots, _, _ = build_case(num_tokens, num_slots, k, [8] * num_slices, rank, max_rank, dtype, device, seed)
    counters = torch.zeros(num_tokens + 3, dtype=torch.int32, device=device)
    ref = kernels.lora_shrink_ref(x.cpu(), a.cpu(), slots)
    has = slots >= 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for _ in range(2):
        h = kernels.lora_shrink_rows(x, a, slots.to(device), counters)
        assert h.shape == (1, num_tokens, a.shape[1])
        torch.testing.assert_close(h[0].cpu()[has], ref[has], atol=tol, rtol=tol)
        assert torch.all(counters.cpu() == 0), counters


def check_expand_rows_case(num_tokens, num_slots, slices, rank, max_rank, dtype, device, split=1, silu=False,
                           seed=0) -> None:
    """kernels/lora.lora_expand_rows against lora_expand_ref (in place), or with `silu` against the reference expand
    followed by SiLU-and-mul with the unfused layers' roundings."""
    from pagedllm.kernels import lora as kernels

    assert not silu or (len(slices) == 2 and slices[0] == slices[1])
    x, a, b, slots, spans, out = build_case(num_tokens, num_slots, 32, slices, rank, max_rank, dtype, device, seed)
    ref_h = kernels.lora_shrink_ref(x.cpu(), a.cpu(), slots)
    h = _split_partials(ref_h, split, seed)
    h[:, slots < 0] = float("nan")  # rows without an adapter: never read
    expected = kernels.lora_expand_ref(ref_h, b.cpu(), out.cpu(), slots, spans)  # fp32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = out.clone()
    starts = tuple(off for off, _ in spans[1:])
    act = kernels.lora_expand_rows(h.to(device), b, got, slots.to(device), () if silu else starts, silu=silu)
    if not silu:
        assert act is None
        torch.testing.assert_close(got.float().cpu(), expected, atol=tol * 4, rtol=tol)
        assert torch.equal(got.cpu()[slots < 0], out.cpu()[slots < 0]), "rows without an adapter changed"
        return
    assert torch.equal(got, out), "silu=True must leave out as it was"
    n = slices[0]
    gate, up = expected[:, :n].to(dtype).float(), expected[:, n:].to(dtype).float()
    ref_act = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype).float()
    torch.testing.assert_close(act.float().cpu(), ref_act, atol=tol * 4, rtol=tol * 2)


def check_gemv_lora_case(num_tokens, num_slots, k, slices, rank, max_rank, dtype, device, split=1, gated=False,
                         bias=False, seed=0) -> None:
    """kernels/gemv.gemv(lora=): the base layer's GEMV with each row's LoRA delta added before the rounding (and, gated,
    before the SiLU-and-mul) against x @ W^T (+ bias) + the reference delta, rounded as the kernel rounds."""
    from pagedllm.kernels import gemv as gemv_kernels
    from pagedllm.kernels import lora as kernels

    assert not gated or (len(slices) == 2 and slices[0] == slices[1])
    x, a, b, slots, spans, _ = build_case(num_tokens, num_slots, k, slices, rank, max_rank, dtype, device, seed)
    n_total = sum(slices)
    gen = torch.Generator().manual_seed(seed + 5)
    w = (torch.randn(n_total, k, generator=gen) * k ** -0.5).to(dtype).to(device)
    bias_t = (torch.randn(n_total, generator=gen) * 0.1).to(dtype).to(device) if bias else None
    ref_h = kernels.lora_shrink_ref(x.cpu(), a.cpu(), slots)
    h = _split_partials(ref_h, split, seed)
    h[:, slots < 0] = float("nan")  # rows without an adapter: never read
    base = x.cpu().float() @ w.cpu().float().t() + (bias_t.cpu().float() if bias else 0.0)
    full = kernels.lora_expand_ref(ref_h, b.cpu(), base, slots, spans)  # fp32: base + delta
    starts = () if gated else tuple(off for off, _ in spans[1:])
    lora = gemv_kernels.GemvLoRA(h.to(device), b, slots.to(device), starts)
    got = gemv_kernels.gemv(x, w, bias_t, gated=gated, lora=lora).float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if gated:
        n = slices[0]
        gate, up = full[:, :n].to(dtype).float(), full[:, n:].to(dtype).float()
        want = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype).float()
    else:
        want = full.to(dtype).float()
    torch.testing.assert_close(got, want, atol=tol * 4, rtol=tol * 2)
    # Rows without an adapter: this GEMV's plain rows, bit for bit (mma=False: without a LoRA, 2+ rows would take
    # the tensor-core GEMV, another kernel with its own rounding).
    plain = gemv_kernels.gemv(x, w, bias_t, gated=gated, mma=False).float().cpu()
    assert torch.equal(got[slots < 0], plain[slots < 0]), "rows without an adapter changed"


def check_output_shrink_case(num_tokens, num_slots, num_heads, num_kv_heads, head_size, rank, max_rank, dtype, device,
                             num_splits=2, seed=0) -> None:
    """kernels/paged_attention.paged_decode_attention(shrink=): the split-KV reduce also computes o_proj's LoRA shrink
    of its output; the output equals the launch without it, bit for bit, and h the reference shrink of that output,
    twice in a row (the counters left at zero). One split (no reduce kernel) leaves the shrink undone."""
    from pagedllm.kernels import lora as kernels
    from pagedllm.kernels.paged_attention import OutputShrink, paged_decode_attention

    gen = torch.Generator().manual_seed(seed)
    block_size, max_ctx = 4, 24
    blocks_per_seq = max_ctx // block_size
    num_blocks = num_tokens * blocks_per_seq + 1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype).to(device)
    block_table = (torch.randperm(num_blocks - 1, generator=gen)[:num_tokens * blocks_per_seq] + 1).view(
        num_tokens, blocks_per_seq).to(torch.int32).to(device)
    seq_lens = torch.randint(1, max_ctx + 1, (num_tokens,), generator=gen).to(torch.int32).to(device)
    q = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype).to(device)
    width = num_heads * head_size
    _, a, _, slots, _, _ = build_case(num_tokens, num_slots, width, [8], rank, max_rank, dtype, device, seed)
    counters = torch.zeros(num_tokens + 1, dtype=torch.int32, device=device)
    scale = head_size ** -0.5
    want = paged_decode_attention(q, cache, block_table, seq_lens, scale, num_tokens, num_splits=num_splits)
    has = slots >= 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for _ in range(2):
        shrink = OutputShrink(a, slots.to(device), counters, torch.zeros(1, num_tokens, a.shape[1], device=device))
        got = paged_decode_attention(q, cache, block_table, seq_lens, scale, num_tokens, num_splits=num_splits,
                                     shrink=shrink)
        assert torch.equal(got, want), "the fold changed the attention output"
        assert shrink.done == (num_splits > 1)
        if shrink.done:
            ref = kernels.lora_shrink_ref(got.reshape(num_tokens, width).cpu(), a.cpu(), slots)
            torch.testing.assert_close(shrink.h[0].cpu()[has], ref[has], atol=tol, rtol=tol)
        assert torch.all(counters.cpu() == 0), counters
