"""Few-row linear layers on the GPU: the Triton GEMV (kernels/gemv.py) against cuBLAS (`F.linear`).

Part 1 times each weight shape alone under CUDA-graph replay, cycling through enough weight copies that nothing is
served from L2. Part 2 times a chain of decoder-layer-shaped kernels (norm, qkv, a stand-in for attention, o_proj,
norm, gate_up + SiLU, down) over every layer of the model shape, as one CUDA graph: there the GEMV's weight
loads overlap the kernel before it (programmatic dependent launch), which a kernel alone does not show.

    python benchmarks/gemv.py                      # Llama-3-8B and Qwen3-0.6B shapes, 1-4 rows
    python benchmarks/gemv.py --chain-only --shapes llama3-8b --rows 1 5 8 16   # verify-step rows (k + 1 per request)

"gemv" is the Triton `kernels.gemv.gemv` run at every row count asked for (the layers themselves give it only the
rows `_rows_kernel` assigns it, and cuBLAS the rest); "mma" the tensor-core GEMV (`kernels.gemv_mma`, <= 32 rows),
which the layers take at 2..PAGEDLLM_GEMV_MMA_MAX_ROWS rows.
    PAGEDLLM_PDL_TRIGGER=0 python benchmarks/gemv.py --chain-only   # A/B of the early launch trigger
    python benchmarks/gemv.py --shapes-only --rows 2 5 8 16 --mma-sweep   # the tensor-core GEMV's launch options
    python benchmarks/gemv.py --chain-only --rows 1 5 8 16 32 --mma-variants   # launch rules in the chain (MMA_VARIANTS)
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from pagedllm.kernels.activation import silu_and_mul
from pagedllm.kernels.gemv import gemv, gemv_ref
from pagedllm.kernels.gemv_mma import MAX_ROWS as MMA_MAX_ROWS
from pagedllm.kernels.gemv_mma import gemv_mma
from pagedllm.kernels.norm import fused_add_rms_norm, rms_norm

SHAPES = {  # name: (hidden, q heads * head, kv heads * head, intermediate, layers)
    "llama3-8b": (4096, 4096, 1024, 14336, 32),
    "qwen3-0.6b": (1024, 2048, 1024, 3072, 28),
}


def linear_shapes(name: str) -> dict[str, tuple[int, int]]:
    """Each linear layer's weight shape (out features, in features) for a model shape."""
    hidden, q, kv, inter, _ = SHAPES[name]
    return {"qkv": (q + 2 * kv, hidden), "o_proj": (hidden, q), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}


def graph_time_us(fn, iters: int = 20) -> float:
    """Mean time of one call of `fn` replayed in a CUDA graph (fn may itself run many kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


# Launch rules of the tensor-core GEMV timed in the chain (--mma-variants): options over gemv_mma's defaults
# (CONFIG + ROW_TILE_CONFIG) for the plain layers (qkv, o, down) and for the gated gate_up, at every row count.
MMA_VARIANTS = {
    "before": ({"unit": 1, "warps": None}, {}),  # the defaults before ROW_TILE_CONFIG
    "u2w8": ({"unit": 2, "warps": 8}, {}),
    "d3": ({"depth": 3}, {"depth": 3}),
    "d4": ({"depth": 4}, {"depth": 4}),
}

MMA_SWEEP = [dict(warps=w, unit=u, depth=d, ct=c) for w in (4, 8, 16) for u in (1, 2) for d in (2, 3) for c in (1, 2)]


def bench_shapes(name: str, rows_list, copies_bytes: float = 2e9, mma_sweep: bool = False) -> None:
    for lin, (n, k) in linear_shapes(name).items():
        copies = max(4, int(copies_bytes // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        gb = n * k * 2 / 1e9
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            gated = lin == "gate_up"
            err = (gemv(x, ws[0], gated=gated).float() - gemv_ref(x, ws[0], gated=gated).float()).abs().max().item()

            def run_cublas():
                for w in ws:
                    y = F.linear(x, w)
                    if gated:
                        silu_and_mul(y)

            t_cublas = graph_time_us(run_cublas) / copies
            results = []
            for block_n in ((1, 2, 4, 8, 16) if m == rows_list[0] else ()):
                if block_n * triton.next_power_of_2(k) * (2 if gated else 1) > 65536:
                    continue
                for warps in (4, 8):
                    def run_gemv(block_n=block_n, warps=warps):
                        for w in ws:
                            gemv(x, w, gated=gated, block_n=block_n, num_warps=warps)
                    t = graph_time_us(run_gemv) / copies
                    results.append((t, block_n, warps))
            t_default = graph_time_us(lambda: [gemv(x, w, gated=gated, mma=False) for w in ws]) / copies
            results.sort()
            t_best, bn, wp = results[0] if results else (t_default, 0, 0)
            print(f"{name:11s} {lin:8s} rows={m} cuBLAS{'+silu' if gated else ''} {t_cublas:7.2f} us "
                  f"({gb / t_cublas * 1e3:5.2f} TB/s) | gemv default {t_default:7.2f} us ({gb / t_default * 1e3:5.2f} TB/s)"
                  f" | best {t_best:7.2f} us block_n={bn} warps={wp} | max err {err:.3g}", flush=True)
            if results:
                print("   all:", " ".join(f"{bn}x{wp}:{t:.1f}" for t, bn, wp in sorted(results, key=lambda r: r[1:])),
                      flush=True)
            if m <= MMA_MAX_ROWS:
                err = (gemv_mma(x, ws[0], gated=gated).float() - gemv_ref(x, ws[0], gated=gated).float()).abs().max()
                t_mma = graph_time_us(lambda: [gemv_mma(x, w, gated=gated) for w in ws]) / copies
                line = (f"{name:11s} {lin:8s} rows={m} mma default {t_mma:7.2f} us ({gb / t_mma * 1e3:5.2f} TB/s, "
                        f"{t_cublas / t_mma:.2f}x cuBLAS) | max err {err.item():.3g}")
                if mma_sweep:
                    timed = []
                    for cfg in MMA_SWEEP:
                        if gated and cfg["ct"] > 1:
                            continue
                        t = graph_time_us(lambda cfg=cfg: [gemv_mma(x, w, gated=gated, config=cfg) for w in ws])
                        timed.append((t / copies, cfg))
                    timed.sort(key=lambda r: r[0])
                    line += f" | best {timed[0][0]:7.2f} us {timed[0][1]}"
                    print(line, flush=True)
                    print("   mma all:", " ".join(f"w{c['warps']}u{c['unit']}d{c['depth']}c{c['ct']}:{t:.1f}"
                                                  for t, c in timed), flush=True)
                else:
                    print(line, flush=True)


def bench_chain(name: str, rows_list, mma_variants: bool = False) -> None:
    hidden, q, _, _, layers = SHAPES[name]
    dt = torch.bfloat16
    ones = lambda n: torch.ones(n, device="cuda", dtype=dt)  # noqa: E731
    weights = [{lin: torch.randn(*shape, device="cuda", dtype=dt) * 0.02 for lin, shape in linear_shapes(name).items()}
               for _ in range(layers)]
    gb = sum(w.numel() * 2 for lw in weights for w in lw.values()) / 1e9
    norm_hidden, norm_q = ones(hidden), ones(q)
    for m in rows_list:
        x0 = torch.randn(m, hidden, device="cuda", dtype=dt)
        r0 = torch.randn(m, hidden, device="cuda", dtype=dt)

        def chain(kind: str, variant: str = ""):
            def lin(v, w, gated=False):
                if kind == "cublas":
                    y = F.linear(v, w)
                    return silu_and_mul(y) if gated else y
                if kind == "mma":
                    return gemv_mma(v, w, gated=gated, config=MMA_VARIANTS[variant][int(gated)] if variant else None)
                return gemv(v, w, gated=gated, mma=False)

            x, r = x0, r0
            for lw in weights:
                h, r = fused_add_rms_norm(x, r, norm_hidden, 1e-5)
                qkv = lin(h, lw["qkv"])
                a = rms_norm(qkv[:, :q], norm_q, 1e-5)  # stand-in for attention: one small kernel
                o = lin(a.contiguous(), lw["o_proj"])
                h, r = fused_add_rms_norm(o, r, norm_hidden, 1e-5)
                x = lin(lin(h, lw["gate_up"], gated=True), lw["down"])
            return x

        t_cublas = graph_time_us(lambda: chain("cublas"), iters=10)
        t_gemv = graph_time_us(lambda: chain("gemv"), iters=10)
        bound = gb / 4.3 * 1e3
        line = (f"chain {name} {layers} layers rows={m}: cuBLAS {t_cublas / 1e3:.3f} ms | gemv {t_gemv / 1e3:.3f} ms "
                f"({t_cublas / t_gemv:.3f}x)")
        if m <= MMA_MAX_ROWS:
            t_mma = graph_time_us(lambda: chain("mma"), iters=10)
            line += f" | mma {t_mma / 1e3:.3f} ms ({t_cublas / t_mma:.3f}x)"
            if mma_variants:
                for variant in MMA_VARIANTS:
                    t = graph_time_us(lambda variant=variant: chain("mma", variant), iters=10)
                    line += f" | {variant} {t / 1e3:.3f} ({t_mma / t:.3f}x)"
        print(f"{line} | weight bytes at 4.3 TB/s {bound / 1e3:.3f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--chain-only", action="store_true", help="only part 2 (the layer chain)")
    parser.add_argument("--shapes-only", action="store_true", help="only part 1 (each weight shape alone)")
    parser.add_argument("--mma-sweep", action="store_true", help="part 1: time the tensor-core GEMV's launch options")
    parser.add_argument("--mma-variants", action="store_true",
                        help="part 2: the chain with each launch rule of MMA_VARIANTS (ratio: default mma / variant)")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.shapes if not args.shapes_only else ():
        bench_chain(name, args.rows, args.mma_variants)
        torch.cuda.empty_cache()
    if not args.chain_only:
        for name in args.shapes:
            bench_shapes(name, args.rows, mma_sweep=args.mma_sweep)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
