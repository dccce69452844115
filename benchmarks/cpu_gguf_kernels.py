"""The GGUF CPU kernels alone at SmolLM2-135M's shapes: `gguf_linear` on the file's row layout and on the layout
the engine loads (`tile_packed`: the 16-row tiles on AVX-512 VNNI machines, the AVX2 row layout on AVX2 ones), vs
oneDNN's prepacked fp32 linear (what the dequantized model runs), 1 thread, interleaved.

    python benchmarks/cpu_gguf_kernels.py [--threads 1] [--rows 1 4 32] [--types Q4_1 Q8_0 Q4_K]

Times are the calling thread's CPU time (time.thread_time, best of 5), so other jobs on a shared machine
distort them less than wall time; the weights here fit the caches (the real model's fp32 weights do not).
"""
from __future__ import annotations

import argparse
import os
import sys
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
    p.add_argument("--fresh-output", action="store_true",
                   help="allocate the output tensor per call, as the model does (large ones page-fault: glibc "
                        "maps allocations over 32 MiB afresh each time)")
    p.add_argument("--types", nargs="+", default=None,
                   help="weight types for every shape (default: the file's, Q4_1 layers and a Q8_0 LM head)")
    args = p.parse_args()
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    from pagedllm.kernels.cpu_ops import cpu_ops
    ops = cpu_ops()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"implementation: {['portable', 'AVX2', 'AVX-512 VNNI'][ops.gguf_best_impl()]}, threads {args.threads}")
    from pagedllm.kernels.gguf_ops import TILED_BASE, _dense_matmul, is_tiled, tile_packed
    shapes = [("gate_up", 3072, 576, Q.Q4_1), ("down", 576, 1536, Q.Q4_1), ("lm_head/12", 4096, 576, Q.Q8_0)]
    if args.types:
        shapes = [(name, n, 1536 if name == "down" else 512, Q[t]) if Q[t] in (Q.Q4_K, Q.Q5_K, Q.Q6_K)
                  else (name, n, k, Q[t]) for t in args.types for name, n, k, _ in shapes]
    for name, n, k, qt in shapes:
        w = rng.standard_normal((n, k)).astype(np.float32)
        try:
            packed = torch.from_numpy(quantize(w, qt))
        except NotImplementedError:  # gguf has no quantizer for this type: random valid blocks
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "unit"))
            from test_gguf_kernels import make_weight
            packed = torch.from_numpy(make_weight(qt, n, k, seed=0))
        tiled, tiled_type = tile_packed(packed, int(qt))
        dense = torch.ops.mkldnn._reorder_linear_weight(torch.from_numpy(w), 32)
        for m in args.rows:
            x = torch.randn(m, k)
            out = torch.empty(m, n)
            fresh = (lambda: torch.empty(m, n)) if args.fresh_output else (lambda: out)
            tq = bench(lambda: ops.gguf_linear(fresh(), x, [packed], [int(qt)], None, 0))
            tf = bench(lambda: torch.ops.mkldnn._linear_pointwise(x, dense, None, "none", [], ""))
            line = f"{name:10s} {qt.name} [{n} x {k}] rows {m:3d}: row layout {tq:8.1f} us"
            loaded = "tiles" if is_tiled(tiled_type) else "AVX2 rows"
            if tiled_type >= TILED_BASE:
                tt = bench(lambda: ops.gguf_linear(fresh(), x, [tiled], [tiled_type], None, 0))
                line += (f"  {loaded} {tt:8.1f} us ({tq / tt:.2f}x)  fp32 {tf:8.1f} us  fp32/{loaded} "
                         f"{tf / tt:.2f}x")
            else:
                line += f"  fp32 {tf:8.1f} us  fp32/row layout {tf / tq:.2f}x"
            if m >= 16:  # what gguf_matmul does for non-tiled parts from DENSE_MIN_ROWS: dequantize, oneDNN
                td = bench(lambda: _dense_matmul(x, [packed], [int(qt)], None, out))
                line += f"  (dense path: row layout {td:8.1f} us"
                if tiled_type >= TILED_BASE and not is_tiled(tiled_type):
                    ta = bench(lambda: _dense_matmul(x, [tiled], [tiled_type], None, out))
                    line += f", {loaded} {ta:8.1f} us"
                line += ")"
            print(line, flush=True)


if __name__ == "__main__":
    main()
