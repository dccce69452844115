"""The decode kernel over an E4M3 cache in Triton's interpreter on the CPU: `TRITON_INTERPRET=1 python
interpret_fp8_decode.py` (run by test_kv_fp8.py). bf16 queries (the fp16 read, `paged_attention.FP8_KV_COMPUTE`),
V read as 32-bit words or not (`FP8_V_WORDS`: the interpreter runs the words' integer twin of the conversion the GPU
does in one instruction), 64- and 128-position tiles, stale NaN bytes past every context, an output scale: the
outputs equal each other bit for bit and the torch reference within bf16 rounding. One split per request only (the
interpreter cannot run the split-KV partial stores)."""
from __future__ import annotations

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
    raw = cache.view(torch.uint8)
    used = set()
    for i, n in enumerate(lens):  # E4M3 NaN (0x7F) in every slot no context holds: a stray read shows
        used.update(table[i, :math.ceil(n / block_size)].tolist())
        if n % block_size:
            raw[:, table[i, (n - 1) // block_size].item(), n % block_size:] = 0x7F
    for b in set(range(num_blocks)) - used:
        raw[:, b] = 0x7F
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), num_heads, head_size, generator=gen).to(torch.bfloat16)
    scale = head_size ** -0.5
    out_scale = torch.tensor([0.5], dtype=torch.float32)
    ref = pa.paged_attention_ref(q, cache, table, seq_lens, torch.arange(len(lens) + 1, dtype=torch.int32),
                                 scale).float() * 0.5
    assert pa.FP8_KV_COMPUTE == "fp16"
    outs, default = {}, pa.FP8_V_WORDS
    for words in (False, True):
        pa.FP8_V_WORDS = words
        for block_n in (128, 64):
            out = pa.paged_decode_attention(q, cache, table, seq_lens, scale, len(lens), num_splits=1,
                                            block_n=block_n, out_scale=out_scale).float()
            assert torch.isfinite(out).all(), (words, block_n)
            err = (out - ref).abs().max().item()
            assert err < 3e-2, (words, block_n, err)
            outs[words, block_n] = out
    pa.FP8_V_WORDS = default
    for block_n in (128, 64):
        assert torch.equal(outs[True, block_n], outs[False, block_n]), block_n
    print("fp8 decode ok")


if __name__ == "__main__":
    main()
