"""Decode-sized linear layers: the Triton skinny GEMM (kernels/skinny_gemm.py) against cuBLAS (F.linear), timed
under CUDA-graph replay with enough weight copies that nothing is served from L2 (as in a forward pass).

    python benchmarks/kernels_gemm.py            # Llama-3-8B and Qwen3-0.6B decode shapes, bf16
    python benchmarks/kernels_gemm.py --sweep    # also every tile config, to choose default_config
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton

from pagedllm.kernels.skinny_gemm import default_config, skinny_gemm

SHAPES = {  # name: (N, K) = (output features, input features)
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
    "q3.qkv": (4096, 1024), "q3.o": (1024, 2048), "q3.gate_up": (6144, 1024), "q3.down": (1024, 3072),
}
CONFIGS = list(itertools.product([16, 32, 64], [128, 256, 512], [4], [3, 4, 6]))


def bench(fn_per_weight, weights) -> float:
    return triton.testing.do_bench_cudagraph(lambda: [fn_per_weight(w) for w in weights], rep=20) / len(weights)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    dtype = torch.bfloat16
    for name, (n, k) in SHAPES.items():
        w0 = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        copies = max(1, min(8, -(-(256 << 20) // (n * k * 2))))
        weights = [w0] + [w0.clone() for _ in range(copies - 1)]
        gb = n * k * 2 / 1e9
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            t_ref = bench(lambda w: F.linear(x, w), weights)
            err = (skinny_gemm(x, w0).float() - F.linear(x, w0).float()).abs().max().item()
            t_def = bench(lambda w: skinny_gemm(x, w), weights)
            line = (f"{name:12s} N={n:6d} K={k:6d} rows {m:2d}: cuBLAS {t_ref * 1e3:7.1f} us ({gb / t_ref:5.2f} TB/s)"
                    f"  skinny {t_def * 1e3:7.1f} us ({gb / t_def:5.2f} TB/s) ratio {t_ref / t_def:4.2f}  err {err:.2g}")
            if args.sweep:
                best = min(CONFIGS, key=lambda c: bench(lambda w: skinny_gemm(x, w, config=c), weights))
                t_best = bench(lambda w: skinny_gemm(x, w, config=best), weights)
                line += f"  best {best}: {t_best * 1e3:7.1f} us"
            print(line, flush=True)


if __name__ == "__main__":
    main()
