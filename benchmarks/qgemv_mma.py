"""The tensor-core int4 GEMV (kernels/qgemv_mma.py) on the GPU: correctness against the fp32 reference, then its
time per 8B layer at 1..8 rows beside bf16 and the tiled int4 path (benchmarks/quant.py's timing: CUDA-graph
replays over enough weight copies that nothing is served from L2), and a launch-config sweep.

    PYTHONUNBUFFERED=1 python benchmarks/qgemv_mma.py [--rows 1 2 4 8] [--sweep [ROWS ...]] [--no-check]
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant import ROTATE_BYTES, SHAPES, Layers, time_us  # noqa: E402

from pagedllm.kernels.qgemv_mma import _next_pow2, dense_weight, dequantize_mma, quant_gemv_mma, to_mma_layout  # noqa: E402


def weights(k, n, group, dtype, perm=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 16, (n, k), device="cuda", generator=gen)
    g = k // group
    scales = (torch.rand(g, n, device="cuda", generator=gen) * 0.01).to(dtype)
    zeros = torch.randint(0, 16, (g, n), device="cuda", generator=gen).to(dtype)
    p = torch.randperm(k, device="cuda", generator=gen).to(torch.int32) if perm else None
    return to_mma_layout(q), scales, zeros, p


def check() -> bool:
    ok = True
    cases = [(k, n, m, 128, torch.bfloat16, False, False) for k, n in SHAPES["8b"].values() for m in (1, 3, 8)]
    cases += [(k, n, 2, 128, torch.bfloat16, False, False) for k, n in SHAPES["0.6b"].values()]
    cases += [(4096, 6144, m, 128, torch.bfloat16, False, m == 20) for m in (12, 20, 64, 100, 300)]
    cases += [(4096, 4096, 5, 128, torch.float16, False, True), (4096, 1024, 1, 128, torch.bfloat16, True, False),
              (4096, 1024, 4, 128, torch.float16, True, True), (1024, 512, 2, 1024, torch.bfloat16, False, False),
              (4096, 512, 7, 64, torch.bfloat16, False, True), (14336, 256, 8, 256, torch.bfloat16, True, False)]
    for k, n, m, group, dtype, perm, bias in cases:
        words, scales, zeros, p = weights(k, n, group, dtype, perm)
        x = torch.randn(m, k, device="cuda").to(dtype)
        b = torch.randn(n, device="cuda").to(dtype) if bias else None
        dense = dequantize_mma(words, scales, zeros, group, p)
        ref = x.float() @ dense.t() + (b.float() if bias else 0)
        for cfg in ({"warps": 4, "unit": 1}, {"warps": 8, "unit": 2}, {"warps": 16, "unit": 2, "mt": 1},
                    {"warps": 8, "depth": 6}, {"warps": 4, "unit": 1, "depth": 8, "mt": 1}, {"warps": 4, "ct": 4},
                    {"warps": 2, "ct": 2, "depth": 3}):
            if cfg.get("mt") == 1 and m > 8:
                continue
            out = quant_gemv_mma(x, words, scales, zeros, group, p, b, cfg)
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            scale = ref.abs().max().item()
            good = err <= 1e-2 * scale
            ok &= good
            print(f"check k={k} n={n} m={m} g={group} {dtype} perm={perm} bias={bias} {cfg}: "
                  f"max err {err:.4g} of {scale:.4g} {'OK' if good else 'BAD'}", flush=True)
    return ok


def sweep(rows):
    """Every launch variant per 8B layer at `rows` (one row tile: 8 rows or fewer, else the tile count given), and
    the sum over the four layers per variant, best first."""
    variants = [{}, {"warps": 4}, {"warps": 8}, {"warps": 16}]
    # column tiles per block sharing each x fragment: x is re-read from L2 once per block, which dominates at 16+ rows
    variants += [{"warps": w, "ct": ct, "unit": u} for w in (None, 2, 4, 8) for ct in (2, 4, 8) for u in (2, 1)]
    for m in rows:
        mt = min(8, _next_pow2((m + 7) // 8))
        totals = {}
        for name, (k, n) in SHAPES["8b"].items():
            per = k * n // 2 + (k // 128) * n * 4
            copies = [weights(k, n, 128, torch.bfloat16, seed=i) for i in range(max(1, math.ceil(ROTATE_BYTES / per)))]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for i, v in enumerate(variants):
                cfg = {**v, "mt": mt}
                if mt > 1 and v.get("depth", 2) > 4 or mt * v.get("ct", 1) > 16:
                    continue
                t = time_us(lambda j: quant_gemv_mma(x, *copies[j][:3], 128, None, None, cfg), len(copies))
                totals[i] = totals.get(i, 0.0) + t
                print(f"  sweep {name:8} rows={m} {v}: {t:.1f} us ({per / t / 1e3:.0f} GB/s)", flush=True)
        for i, t in sorted(totals.items(), key=lambda kv: kv[1])[:12]:
            print(f"sweep one layer rows={m} {variants[i]}: {t:.1f} us", flush=True)


def bench(rows):
    totals = {}
    for name, (k, n) in SHAPES["8b"].items():
        layers = Layers(k, n, ["bf16", "int4"])
        per = k * n // 2 + (k // 128) * n * 4
        copies = [weights(k, n, 128, torch.bfloat16, seed=i) for i in range(max(1, math.ceil(ROTATE_BYTES / per)))]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = time_us(lambda i: layers.call("bf16", x, i), len(layers.copies["bf16"]))
            t_int4 = time_us(lambda i: layers.call("int4", x, i), len(layers.copies["int4"]))
            t_mma = time_us(lambda i: quant_gemv_mma(x, *copies[i][:3], 128), len(copies))
            t_dense = float("nan")
            if m > 8:  # the many-rows path: dequantize into the buffer, then cuBLAS
                t_dense = time_us(lambda i: torch.nn.functional.linear(x, dense_weight(*copies[i][:3], 128)),
                                  len(copies))
            for key, v in (("bf16", t_bf16), ("int4", t_int4), ("mma", t_mma), ("dense", t_dense)):
                totals[(m, key)] = totals.get((m, key), 0.0) + v
            print(f"{name:8} rows={m}: bf16 {t_bf16:.1f} us, int4 tiled {t_int4:.1f} us ({per / t_int4 / 1e3:.0f} GB/s), "
                  f"mma {t_mma:.1f} us ({per / t_mma / 1e3:.0f} GB/s); mma vs bf16 {t_bf16 / t_mma:.2f}x; "
                  f"dequant + cuBLAS {t_dense:.1f} us",
                  flush=True)
    for m in rows:
        b, i, q, d = (totals[(m, key)] for key in ("bf16", "int4", "mma", "dense"))
        print(f"one layer, {m} rows: bf16 {b:.1f} us, int4 tiled {i:.1f} us ({b / i:.2f}x), mma {q:.1f} us "
              f"({b / q:.2f}x bf16, {i / q:.2f}x tiled), dequant + cuBLAS {d:.1f} us ({b / d:.2f}x bf16)", flush=True)


def once(rows: int, layer: str, cfg: dict) -> None:
    """A few eager calls of one 8B layer's GEMV (for a profiler: `ncu --kernel-name qgemv_mma ...`)."""
    k, n = SHAPES["8b"][layer]
    words, scales, zeros, _ = weights(k, n, 128, torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(8):
        quant_gemv_mma(x, words, scales, zeros, 128, None, None, cfg)
    torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256, 1024])
    p.add_argument("--sweep", type=int, nargs="*", metavar="ROWS",
                   help="launch variants per layer at these row counts (default 1 and 16) instead of the table")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--once", nargs=2, metavar=("ROWS", "LAYER"), help="eager calls of one layer, for a profiler")
    p.add_argument("--config", default="{}", help="the launch config of --once (a Python dict)")
    args = p.parse_args()
    if args.once:
        import ast
        once(int(args.once[0]), args.once[1], ast.literal_eval(args.config))
        return
    if not args.no_check:
        print("correctness:", "all OK" if check() else "FAILURES", flush=True)
    if args.sweep is not None:
        sweep(args.sweep or [1, 16])
    else:
        bench(args.rows)


if __name__ == "__main__":
    main()
