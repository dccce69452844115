"""The GGUF CPU kernels alone at SmolLM2-135M's shapes: `gguf_linear` (packed Q4_1 / Q8_0 blocks, integer dot
products) vs oneDNN's prepacked fp32 linear (what the dequantized model runs), 1 thread, interleaved.

    python benchmarks/cpu_gguf_kernels.py [--threads 1] [--rows 1 4 32]

Times are the calling thread's CPU time (time.thread_time, best of 5), so other jobs on a shared machine
distort them less than wall time; the weights here fit the caches (the real model's fp32 weights do not).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def bench(fn, n=100):
    for _ in range(3):
        fn()
    best = 1e9
    for _ in range(5):
        t = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t) / n)
    return best * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    args = p.parse_args()
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    from pagedllm.kernels.cpu_ops import cpu_ops
    ops = cpu_ops()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"implementation: {['portable', 'AVX2', 'AVX-512 VNNI'][ops.gguf_best_impl()]}, threads {args.threads}")
    for name, n, k, qt in (("gate_up", 3072, 576, Q.Q4_1), ("down", 576, 1536, Q.Q4_1),
                           ("lm_head/12", 4096, 576, Q.Q8_0)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        packed = torch.from_numpy(quantize(w, qt))
        dense = torch.ops.mkldnn._reorder_linear_weight(torch.from_numpy(w), 32)
        for m in args.rows:
            x = torch.randn(m, k)
            out = torch.empty(m, n)
            tq = bench(lambda: ops.gguf_linear(out, x, [packed], [int(qt)], None, 0))
            tf = bench(lambda: torch.ops.mkldnn._linear_pointwise(x, dense, None, "none", [], ""))
            line = (f"{name:10s} {qt.name} [{n} x {k}] rows {m:3d}: packed {tq:8.1f} us  fp32 {tf:8.1f} us  "
                    f"fp32/packed {tf / tq:.2f}x")
            if m >= 16:  # what gguf_matmul does from DENSE_MIN_ROWS: dequantize, then oneDNN unprepacked
                from pagedllm.quantization.gguf import _dense_matmul
                td = bench(lambda: _dense_matmul(x, [packed], [int(qt)], None, out))
                line += f"  dense path {td:8.1f} us"
            print(line, flush=True)


if __name__ == "__main__":
    main()
