"""Run AD (dropped): the split-K Triton GEMM (src/pagedllm/kernels/splitk_gemm.py, with and without an L2 bulk
prefetch of its weights before the PDL wait) against cuBLAS at Qwen3-0.6B shapes, 28 weight copies per chain.
    python3 benchmarks/splitk_gemm.py 8,32,128,256
"""
import sys, torch, triton, triton.testing
import torch.nn.functional as F
from pagedllm.kernels.splitk_gemm import splitk_gemm
from pagedllm.kernels.activation import silu_and_mul
DEV = "cuda"; DT = torch.bfloat16
L = 28
shapes = {"qkv": (4096, 1024, False), "o": (1024, 2048, False), "gate_up": (6144, 1024, True), "down": (1024, 3072, False)}
rows = [int(r) for r in sys.argv[1].split(",")]
def t(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=25, return_mode="median") * 1e3
best = {}
CFGS = [(64, 64, 64, 1, 4, 4), (64, 64, 64, 2, 4, 4), (64, 64, 64, 4, 4, 4), (128, 64, 64, 1, 8, 4), (128, 64, 64, 2, 8, 4),
        (128, 64, 64, 4, 8, 4), (64, 128, 64, 1, 4, 4), (64, 128, 64, 2, 4, 4), (64, 32, 64, 1, 4, 4), (64, 32, 64, 2, 4, 4)]
for name, (n_total, k, gated) in shapes.items():
    ws = [torch.randn(n_total, k, device=DEV, dtype=DT) * 0.02 for _ in range(L)]
    for m in rows:
        x = torch.randn(m, k, device=DEV, dtype=DT)
        ref = F.linear(x, ws[0]); ref = silu_and_mul(ref) if gated else ref
        def cub():
            for w in ws:
                y = F.linear(x, w)
                if gated: silu_and_mul(y)
        tc = t(cub) / L
        res = {}
        for pf in (False, True):
            for cfg in CFGS:
                if k % (64 * cfg[3]): continue
                y = splitk_gemm(x, ws[0], gated=gated, config=cfg, prefetch=pf)
                err = (y.float() - ref.float()).abs().max().item()
                assert err < 0.1, (name, m, cfg, pf, err)
                res[(pf, cfg)] = t(lambda: [splitk_gemm(x, w, gated=gated, config=cfg, prefetch=pf) for w in ws]) / L
        b0 = min((v, c) for (pf, c), v in res.items() if not pf)
        b1 = min((v, c) for (pf, c), v in res.items() if pf)
        top = " ".join(f"{c[0]}/{c[1]}/s{c[3]}:{v:.1f}" for (pf, c), v in sorted(res.items(), key=lambda kv: kv[1]) if pf)
        print(f"{name:8s} m={m:3d} cuBLAS{'+silu' if gated else ''} {tc:6.2f} | no-prefetch best {b0[0]:6.2f} {b0[1]} | "
              f"prefetch best {b1[0]:6.2f} {b1[1]} | {top}", flush=True)
        best[(name, m)] = (tc, b1[0])
for m in rows:
    c = sum(best[(nm, m)][0] for nm in shapes); s = sum(best[(nm, m)][1] for nm in shapes)
    print(f"layer m={m}: cuBLAS {c:.1f} us, best prefetch split-K {s:.1f} us ({c/s:.2f}x); per step x28: saves {(c-s)*28/1e3:.3f} ms")
