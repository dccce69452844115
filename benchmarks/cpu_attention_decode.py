"""One decode row of the C++ paged attention (kernels/csrc/cpu_ops.cpp: paged_attention) at Gemma 3 270M's
heads (4 query heads, 1 KV head, head size 256, float32 KV, 16-token blocks), per layer call, at a few context
lengths. Run it with two source trees' PYTHONPATH to compare builds (each builds its own kernels).

    python benchmarks/cpu_attention_decode.py [--threads 1] [--contexts 128 256 512]

Best of 7 rounds of 50 calls, wall time (the product is too short for thread CPU time's resolution).
"""
from __future__ import annotations

import argparse
import time


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512])
    args = p.parse_args()
    import pagedllm  # noqa: F401  before torch (OpenMP wait policy)
    import torch

    from pagedllm.kernels.cpu_ops import cpu_ops
    ops = cpu_ops()
    torch.set_num_threads(args.threads)
    block, head, kv_heads, q_heads = 16, 256, 1, 4
    blocks = (max(args.contexts) + block - 1) // block
    k_cache = torch.randn(blocks, kv_heads, head, block)
    v_cache = torch.randn(blocks, kv_heads, block, head)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    starts = torch.tensor([0, 1], dtype=torch.int32)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"threads {args.threads}, load {load}")
    for ctx in args.contexts:
        q = torch.randn(1, q_heads, head)
        out = torch.empty_like(q)
        lens = torch.tensor([ctx], dtype=torch.int32)
        for _ in range(10):
            ops.paged_attention(out, q, k_cache, v_cache, table, starts, lens, head ** -0.5, 0, 0, 0.0)
        best = 1e9
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(50):
                ops.paged_attention(out, q, k_cache, v_cache, table, starts, lens, head ** -0.5, 0, 0, 0.0)
            best = min(best, (time.perf_counter() - t) / 50)
        print(f"context {ctx}: {best * 1e6:.1f} us per layer call ({best * 18e3:.2f} ms for 18 layers)")


if __name__ == "__main__":
    main()
