"""The decode kernel's fused split reduce in Triton's interpreter on the CPU: `TRITON_INTERPRET=1 python
interpret_split_reduce.py` (run by test_split_reduce_interpreted.py). A split launch whose last split program of
each (request, kv head) combines the splits (PAGEDLLM_FUSED_SPLIT_REDUCE=1) against the same launch with the
reduce kernel and the torch reference: GQA 1 / 3 / 8, head sizes 64 / 128, fp32 and fp16 (the interpreter computes bf16 dots wrongly), empty and one-token
contexts, empty trailing splits, a sliding window, soft-capped scores, an output scale and a start order; the
counters are zero again after each launch; the same for few-query launches (verify rows)."""
from __future__ import annotations

import itertools
import math
import os
import sys

import torch


def _paged_cache(lens: list[int], num_kv: int, head_size: int, dtype: torch.dtype, gen: torch.Generator,
                 block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random cache (with spare blocks), each request's blocks at random places, and the lengths."""
    max_blocks = max(math.ceil(n / block_size) for n in lens) + 1
    num_blocks = len(lens) * max_blocks + 3
    cache = torch.randn(2, num_blocks, block_size, num_kv, head_size, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:len(lens) * max_blocks].view(len(lens), -1)
    return cache, table.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lora"))
    from interpret_kernels import interpret_attention_kernels

    interpret_attention_kernels(__file__)
    from pagedllm.kernels import paged_attention as pa

    gen = torch.Generator().manual_seed(0)
    cases = [  # (num_heads, num_kv_heads, head_size, dtype, context lengths, splits, extra arguments)
        (9, 3, 64, torch.float32, [1, 37, 130, 300, 0], (2, 4, 16), {}),
        (32, 4, 128, torch.float16, [200, 5, 64], (4, 16), {}),
        (8, 8, 64, torch.float32, [77, 1], (3, 16), {"sliding_window": 40}),
        (16, 2, 128, torch.float32, [150, 20], (8,), {"logits_soft_cap": 30.0}),
        (12, 4, 64, torch.float16, [90, 250, 33], (4,), {"out_scale": torch.tensor([0.5])}),
        (9, 3, 64, torch.float32, [33, 260, 120], (4,), {"order": torch.tensor([1, 2, 0], dtype=torch.int32)}),
    ]
    for num_heads, num_kv, head_size, dtype, lens, split_counts, extra in cases:
        cache, table, seq_lens = _paged_cache(lens, num_kv, head_size, dtype, gen)
        q = torch.randn(len(lens), num_heads, head_size, generator=gen).to(dtype)
        scale = head_size ** -0.5
        ref_kw = {k: v for k, v in extra.items() if k in ("sliding_window", "logits_soft_cap")}
        ref = pa.paged_attention_ref(q, cache, table, seq_lens, torch.arange(len(lens) + 1, dtype=torch.int32),
                                     scale, **ref_kw).float()
        if "out_scale" in extra:
            ref = ref * extra["out_scale"].item()
        for splits in split_counts:
            outs = {}
            for fused in ("0", "1"):
                os.environ["PAGEDLLM_FUSED_SPLIT_REDUCE"] = fused
                outs[fused] = pa.paged_decode_attention(q, cache, table, seq_lens, scale, len(lens),
                                                        num_splits=splits, **extra).float()
            assert int(pa.split_reduce_counters(q.device).abs().sum()) == 0, "counters left set"
            tol = 1e-5 if dtype == torch.float32 else 2e-3
            assert (outs["1"] - outs["0"]).abs().max().item() <= tol, (num_heads, num_kv, splits)
            err = (outs["1"] - ref).abs().max().item()
            assert err <= 10 * tol, (num_heads, num_kv, splits, err, (outs["0"] - ref).abs().max().item())
            assert torch.count_nonzero(outs["1"][seq_lens == 0]) == 0
    # Few-query launches (verify rows): requests of 1..5 query tokens, every split writing its part.
    for num_heads, num_kv, head_size, dtype, q_lens, ctx_lens, extra in (
            (9, 3, 64, torch.float32, [5, 1, 3, 0], [120, 7, 300, 0], {}),
            (16, 2, 128, torch.float16, [2, 5], [64, 250], {"sliding_window": 50}),
            (8, 8, 64, torch.float32, [4, 4, 4], [30, 200, 1], {"out_scale": torch.tensor([2.0])})):
        lens = [c + q for c, q in zip(ctx_lens, q_lens)]
        cache, table, seq_lens = _paged_cache(lens, num_kv, head_size, dtype, gen)
        qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
        q = torch.randn(int(qsl[-1]), num_heads, head_size, generator=gen).to(dtype)
        scale = head_size ** -0.5
        ref = pa.paged_attention_ref(q, cache, table, seq_lens, qsl, scale, num_seqs=len(lens),
                                     sliding_window=extra.get("sliding_window")).float()
        if "out_scale" in extra:
            ref = ref * extra["out_scale"].item()
        q_pad = pa.few_query_pad(max(q_lens), num_heads, num_kv)
        for splits in (2, 8):
            outs = {}
            for fused in ("0", "1"):
                os.environ["PAGEDLLM_FUSED_SPLIT_REDUCE"] = fused
                outs[fused] = pa.paged_few_query_attention(q, cache, table, seq_lens, qsl, scale, len(lens), q_pad,
                                                           num_splits=splits, **extra).float()
            assert int(pa.split_reduce_counters(q.device).abs().sum()) == 0, "counters left set"
            tol = 1e-5 if dtype == torch.float32 else 2e-3
            assert (outs["1"] - outs["0"]).abs().max().item() <= tol, ("few", num_heads, num_kv, splits)
            err = (outs["1"] - ref).abs().max().item()
            assert err <= 10 * tol, ("few", num_heads, num_kv, splits, err)
    print("split reduce ok")


if __name__ == "__main__":
    main()
