"""Where a LoRA decode step's time goes: the kernels of one decoder layer (attention left out) at batch 1, on the
Llama-3-8B shapes, timed as CUDA-graph replays (programmatic dependent launch as in the engine).

    python benchmarks/lora_parts.py [--rank 16] [--reps 50]

Prints us per kernel (the kernel repeated `reps` times in one graph) and per layer chain:
  base      norm, qkv GEMV, o GEMV, norm, gate_up+SiLU GEMV, down GEMV (no adapter)
  separate  base + the general shrink and expand kernels per projection, gate_up and SiLU apart (FUSED_DECODE off)
  rows      the few-row path (the default): qkv / gate_up shrink in the norm, few-token shrink for o / down, a
            few-token expand per projection (gate_up's with the SiLU-and-mul)
and each kernel's registers and spills.
"""
from __future__ import annotations

import argparse
import json

import torch


def timed(fn, reps: int, iters: int = 20) -> float:
    """us per call of fn, from a CUDA graph holding `reps` calls, median of `iters` replays."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--kv", type=int, default=1024)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from pagedllm.kernels import activation, gemv as g, lora, norm

    dev, dt = torch.device("cuda"), torch.bfloat16
    hd, inter, kv, r = args.hidden, args.intermediate, args.kv, max(16, args.rank)
    torch.manual_seed(0)

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, device=dev) * scale).to(dt)

    w_qkv, w_o, w_gu, w_down = rnd(hd + 2 * kv, hd), rnd(hd, hd), rnd(2 * inter, hd), rnd(hd, inter)
    nw = torch.ones(hd, device=dev, dtype=dt)
    x, res, attn, act = rnd(1, hd, scale=1), rnd(1, hd, scale=1), rnd(1, hd, scale=1), rnd(1, inter, scale=1)
    slots = torch.zeros(1, dtype=torch.int32, device=dev)
    sorted_ids = torch.zeros(1, dtype=torch.int32, device=dev)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    a_qkv, a_o, a_gu, a_down = rnd(1, 3 * r, hd), rnd(1, r, hd), rnd(1, 2 * r, hd), rnd(1, r, inter)
    b_qkv, b_o, b_gu, b_down = rnd(1, r, hd + 2 * kv), rnd(1, r, hd), rnd(1, r, 2 * inter), rnd(1, r, hd)
    qkv_spans = [(0, hd), (hd, kv), (hd + kv, kv)]
    h_qkv = torch.zeros(1, 1, 3 * r, device=dev)
    h_gu = torch.zeros(1, 1, 2 * r, device=dev)
    counters = torch.zeros(16, dtype=torch.int32, device=dev)
    h_o = lora.lora_shrink(attn, a_o, sorted_ids, starts)
    h_o1 = h_o[:1]

    kernels = {
        "norm": lambda: norm.fused_add_rms_norm(x, res, nw, 1e-5),
        "norm+shrink qkv": lambda: norm.rms_norm_shrink(x, res, nw, 1e-5, False, a_qkv, slots),
        "norm+shrink gate_up": lambda: norm.rms_norm_shrink(x, res, nw, 1e-5, False, a_gu, slots),
        "gemv qkv": lambda: g.gemv(x, w_qkv),
        "gemv o": lambda: g.gemv(attn, w_o),
        "gemv gate_up+silu": lambda: g.gemv(x, w_gu, gated=True),
        "gemv gate_up": lambda: g.gemv(x, w_gu),
        "silu_and_mul": lambda: activation.silu_and_mul(rnd_gu),
        "gemv down": lambda: g.gemv(act, w_down),
        "shrink o": lambda: lora.lora_shrink(attn, a_o, sorted_ids, starts),
        "shrink down": lambda: lora.lora_shrink(act, a_down, sorted_ids, starts),
        "shrink qkv": lambda: lora.lora_shrink(x, a_qkv, sorted_ids, starts),
        "shrink_rows o": lambda: lora.lora_shrink_rows(attn, a_o, slots, counters),
        "shrink_rows down": lambda: lora.lora_shrink_rows(act, a_down, slots, counters),
        "expand_rows qkv": lambda: lora.lora_expand_rows(h_qkv, b_qkv, out_qkv, slots, (hd, hd + kv)),
        "expand_rows o": lambda: lora.lora_expand_rows(h_o1, b_o, out_o, slots),
        "expand_rows gate_up+silu": lambda: lora.lora_expand_rows(h_gu, b_gu, rnd_gu, slots, silu=True),
        "expand o": lambda: lora.lora_expand(h_o, b_o, out_o, sorted_ids, starts, [(0, hd)]),
        "expand qkv": lambda: lora.lora_expand(h_qkv, b_qkv, out_qkv, sorted_ids, starts, qkv_spans),
    }
    rnd_gu = rnd(1, 2 * inter, scale=1)
    out_o, out_qkv = rnd(1, hd), rnd(1, hd + 2 * kv)

    def chain_base():
        y, rr = norm.fused_add_rms_norm(x, res, nw, 1e-5)
        g.gemv(y, w_qkv)
        g.gemv(attn, w_o)
        y, rr = norm.fused_add_rms_norm(x, res, nw, 1e-5)
        g.gemv(y, w_gu, gated=True)
        g.gemv(act, w_down)

    def chain_separate():
        y, rr = norm.fused_add_rms_norm(x, res, nw, 1e-5)
        q = g.gemv(y, w_qkv)
        lora.lora_expand(lora.lora_shrink(y, a_qkv, sorted_ids, starts), b_qkv, q, sorted_ids, starts, qkv_spans)
        o = g.gemv(attn, w_o)
        lora.lora_expand(lora.lora_shrink(attn, a_o, sorted_ids, starts), b_o, o, sorted_ids, starts, [(0, hd)])
        y, rr = norm.fused_add_rms_norm(x, res, nw, 1e-5)
        gu = g.gemv(y, w_gu)
        lora.lora_expand(lora.lora_shrink(y, a_gu, sorted_ids, starts), b_gu, gu, sorted_ids, starts,
                         [(0, inter), (inter, inter)])
        activation.silu_and_mul(gu)
        d = g.gemv(act, w_down)
        lora.lora_expand(lora.lora_shrink(act, a_down, sorted_ids, starts), b_down, d, sorted_ids, starts, [(0, hd)])

    def chain_rows():
        y, rr, h = norm.rms_norm_shrink(x, res, nw, 1e-5, False, a_qkv, slots)
        lora.lora_expand_rows(h, b_qkv, g.gemv(y, w_qkv), slots, (hd, hd + kv))
        h = lora.lora_shrink_rows(attn, a_o, slots, counters)
        lora.lora_expand_rows(h, b_o, g.gemv(attn, w_o), slots)
        y, rr, h = norm.rms_norm_shrink(x, res, nw, 1e-5, False, a_gu, slots)
        lora.lora_expand_rows(h, b_gu, g.gemv(y, w_gu), slots, silu=True)
        h = lora.lora_shrink_rows(act, a_down, slots, counters)
        lora.lora_expand_rows(h, b_down, g.gemv(act, w_down), slots)

    results = {}
    for name, fn in kernels.items():
        try:
            results[name] = timed(fn, args.reps)
        except Exception as e:  # report and go on with the others
            print(f"{name:32s} failed: {e!r}"[:300], flush=True)
            continue
        print(f"{name:32s} {results[name]:8.2f} us", flush=True)
    for name, fn in (("chain base", chain_base), ("chain separate", chain_separate), ("chain rows", chain_rows)):
        results[name] = timed(fn, max(1, args.reps // 5))
        print(f"{name:32s} {results[name]:8.2f} us", flush=True)
    for kname, kern in (("gemv", g._gemv_kernel), ("norm_shrink", norm._rms_norm_shrink_kernel),
                        ("shrink", lora._shrink_kernel), ("shrink_rows", lora._shrink_rows_kernel)):
        try:
            caches = [c[0] if isinstance(c, tuple) else c for c in kern.device_caches.values()]
            for cache in caches:
                for key, compiled in cache.items():
                    print(f"regs {kname}: n_regs={getattr(compiled, 'n_regs', '?')} "
                          f"n_spills={getattr(compiled, 'n_spills', '?')} {str(key)[-200:]}", flush=True)
        except Exception as e:  # the cache layout is Triton's internal: report, do not fail the benchmark
            print(f"regs {kname}: not available ({e!r})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
