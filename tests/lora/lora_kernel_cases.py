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
