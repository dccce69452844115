"""The decode kernel over an E4M3 cache in Triton's interpreter on the CPU: `TRITON_INTERPRET=1 python
interpret_fp8_decode.py` (run by test_kv_fp8.py). bf16 queries (the fp16 read, `paged_attention.FP8_KV_COMPUTE`),
V read as 32-bit words or not (`FP8_V_WORDS`: the interpreter runs the words' integer twin of the conversion the GPU
does in one instruction), 64- and 128-position tiles, with and without a sliding window that starts inside a tile,
stale NaN bytes in every slot no context holds, an output scale: the outputs equal the torch reference within bf16
rounding, and the two reads equal each other bit for bit. The prefill and few-query kernels over the same cache,
and the E4M3 stores of reshape_and_cache and qkv_prep, are checked too. One split per request only (the
interpreter cannot run the split-KV partial stores)."""
from __future__ import annotations

import itertools
import math
import os
import sys

import torch


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lora"))
    from interpret_kernels import interpret_attention_kernels

    interpret_attention_kernels(__file__)
    from pagedllm.kernels import paged_attention as pa

    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv, head_size, block_size = 16, 8, 128, 16
    lens = [1, 37, 130, 300]
    max_blocks = max(math.ceil(n / block_size) for n in lens) + 1
    num_blocks = len(lens) * max_blocks + 3
    cache = (torch.randn(2, num_blocks, block_size, num_kv, head_size, generator=gen) * 2).to(torch.float8_e4m3fn)
    table = torch.randperm(num_blocks, generator=gen)[:len(lens) * max_blocks].view(len(lens), -1).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), num_heads, head_size, generator=gen).to(torch.bfloat16)
    scale = head_size ** -0.5
    out_scale = torch.tensor([0.5], dtype=torch.float32)
    assert pa.FP8_KV_COMPUTE == "fp16"
    raw = cache.view(torch.uint8)
    used = set()
    for i, n in enumerate(lens):  # E4M3 NaN (0x7F) in every slot no context holds: a stray read shows
        used.update(table[i, :math.ceil(n / block_size)].tolist())
        if n % block_size:
            raw[:, table[i, (n - 1) // block_size].item(), n % block_size:] = 0x7F
    for b in set(range(num_blocks)) - used:
        raw[:, b] = 0x7F
    outs, default = {}, pa.FP8_V_WORDS
    for words in (False, True):
        pa.FP8_V_WORDS = words
        for window in (None, 53):
            ref = pa.paged_attention_ref(q, cache, table, seq_lens, torch.arange(len(lens) + 1, dtype=torch.int32),
                                         scale, sliding_window=window).float() * 0.5
            for block_n in (128, 64):
                out = pa.paged_decode_attention(q, cache, table, seq_lens, scale, len(lens), num_splits=1,
                                                block_n=block_n, out_scale=out_scale, sliding_window=window).float()
                key = (words, window, block_n)
                assert torch.isfinite(out).all(), key
                err = (out - ref).abs().max().item()
                assert err < 3e-2, (key, err)
                outs[key] = out
    pa.FP8_V_WORDS = default
    for window in (None, 53):
        for block_n in (128, 64):
            assert torch.equal(outs[True, window, block_n], outs[False, window, block_n]), (window, block_n)
    check_other_kernels(pa, cache, table, lens, num_heads, head_size, scale, gen)
    check_writers(gen)
    print("fp8 decode ok")


def check_other_kernels(pa, cache, table, lens, num_heads, head_size, scale, gen) -> None:
    """The prefill and few-query kernels over the E4M3 cache (the few-query kernel reads V as words): each request's
    last 3 positions as queries (a verify step), against the torch reference, with and without a window."""
    q_lens = [min(3, n) for n in lens]
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), num_heads, head_size, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for window in (None, 53):
        ref = pa.paged_attention_ref(q, cache, table, seq_lens, qsl, scale, sliding_window=window).float()
        got = {"prefill": pa.paged_prefill_attention(q, cache, table, seq_lens, qsl, scale, len(lens), max(q_lens),
                                                     sliding_window=window, block_n=64),
               "few-query": pa.paged_few_query_attention(q, cache, table, seq_lens, qsl, scale, len(lens),
                                                         q_pad=pa.few_query_pad(3, num_heads, cache.shape[3]),
                                                         num_splits=1, block_n=64, sliding_window=window)}
        for name, out in got.items():
            err = ((out.float() - ref).abs() - 1e-2 * ref.abs()).max().item()  # (bf16 outputs up to ~8)
            assert torch.isfinite(out).all() and err < 3e-2, (name, window, err)


def check_writers(gen) -> None:
    """reshape_and_cache's E4M3 stores equal reshape_and_cache_ref's (within the interpreter's rounding), and
    qkv_prep stores V where they do."""
    from pagedllm.kernels import reshape_and_cache as rc

    num_blocks, block_size, num_kv, head_size = 6, 16, 4, 64
    slots = torch.tensor([5, 17, 18, 40, 95, -1, 3], dtype=torch.int64)
    key = torch.randn(len(slots), num_kv, head_size, generator=gen).to(torch.bfloat16)
    value = torch.randn(len(slots), num_kv, head_size, generator=gen).to(torch.bfloat16)
    got = torch.zeros(2, num_blocks, block_size, num_kv, head_size).to(torch.float8_e4m3fn)
    want = got.clone()
    rc.reshape_and_cache(key, value, got, slots)
    rc.reshape_and_cache_ref(key, value, want, slots)
    # (the interpreter rounds ~1% of float -> E4M3 conversions one step off: test_kv_fp8_kernels.py)
    g, w = got.float(), want.float()
    assert ((g - w).abs() > 0.13 * w.abs() + 1e-3).float().mean().item() <= 0.02
    stored, v = got[1].float()[slots[-1] // block_size, slots[-1] % block_size], value[-1].float()
    assert ((stored - v).abs() <= 0.07 * v.abs() + 1e-2).float().mean().item() >= 0.95  # (half an E4M3 step)
    # qkv_prep's stores (K rotated, V as given)
    from pagedllm.kernels.qkv_prep import qkv_prep
    from pagedllm.layers.rotary_embedding import get_rope

    num_q = 8
    qkv = torch.randn(len(slots), (num_q + 2 * num_kv) * head_size, generator=gen).to(torch.bfloat16)
    positions = torch.arange(len(slots))
    cos_sin = get_rope(head_size, 64, {"rope_type": "default", "rope_theta": 10000.0}).cos_sin_cache.float()
    cache = torch.zeros_like(got)
    qkv_prep(qkv.clone(), positions, cos_sin, cache, slots, num_q, num_kv, head_size)
    v_in = qkv[:, (num_q + num_kv) * head_size:].reshape(len(slots), num_kv, head_size).float()
    keep = slots >= 0
    stored = cache[1].float()[slots[keep] // block_size, slots[keep] % block_size]
    assert ((stored - v_in[keep]).abs() <= 0.07 * v_in[keep].abs() + 1e-2).float().mean().item() >= 0.95


if __name__ == "__main__":
    main()
