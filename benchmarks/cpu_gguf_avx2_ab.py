"""Gemma 3 270M's decode products (one activation row) on an AVX2 machine without VNNI, in one process,
interleaved: each layer type of the real file, and Q5_0 vs the same rows widened to Q8_0 at load
(`kernels/gguf_ops.py: widen_packed`). Random weights of the model's shapes and types.

    python benchmarks/cpu_gguf_avx2_ab.py [--threads 1] [--reps 9] [--lm-head]

Times are the calling thread's CPU time per call (best of --reps rounds of 30 calls), so other jobs on a
shared machine distort them less than wall time; the weights fit the caches. --lm-head times instead the
262,144 x 640 Q8_0 LM head (178 MB, streamed from memory; best of --reps rounds of 3 calls): run it with two
source trees' PYTHONPATH to compare builds.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--lm-head", action="store_true")
    args = p.parse_args()
    import pagedllm  # noqa: F401  before torch (OpenMP wait policy)
    import torch
    from gguf import GGMLQuantizationType as Q
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quantize

    from pagedllm.kernels.cpu_ops import cpu_ops
    ops = cpu_ops()
    if ops.gguf_best_impl() != 1:
        raise SystemExit("this A/B is for AVX2 machines without AVX-512 VNNI (gguf_best_impl() == 1)")
    torch.set_num_threads(args.threads)

    def make(qt, n, k):
        rng = np.random.default_rng(n + k)
        try:
            return torch.from_numpy(quantize(rng.standard_normal((n, k)).astype(np.float32), qt))
        except NotImplementedError:  # K-quants: random blocks, small finite scales
            elems, nbytes = GGML_QUANT_SIZES[qt]
            blocks = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
            sc = (rng.random((n, k // elems, 2)) * 0.02 + 1e-3).astype(np.float16).view(np.uint8)
            if qt == Q.Q6_K:
                blocks[..., 208:210] = sc[..., 0:2]
            else:
                blocks[..., 0:4] = sc.reshape(n, k // elems, 4)
            return torch.from_numpy(blocks.reshape(n, -1))

    if args.lm_head:
        head = make(Q.Q8_0, 262144, 640)
        x = torch.randn(1, 640)
        out = torch.empty(1, 262144)
        best = 1e9
        for _ in range(args.reps):
            t = time.thread_time()
            for _ in range(3):
                ops.gguf_linear(out, x, [head], [int(Q.Q8_0)], None, 0)
            best = min(best, (time.thread_time() - t) / 3)
        print(f"LM head Q8_0 [262144 x 640], one activation row, threads {args.threads}: {best * 1e3:.2f} ms "
              f"(the calling thread's CPU time); {_load()}")
        return
    # (name, type, N, K): q / gate_up Q5_0, o_proj / down Q4_K, down Q6_K (per layer of the real file)
    cases = [("q_proj Q5_0", Q.Q5_0, 1024, 640), ("gate_up Q5_0", Q.Q5_0, 4096, 640),
             ("o_proj Q4_K", Q.Q4_K, 640, 1024), ("down Q4_K", Q.Q4_K, 640, 2048), ("down Q6_K", Q.Q6_K, 640, 2048),
             ("qkv Q8_0", Q.Q8_0, 1536, 640)]
    variants = []
    for name, qt, n, k in cases:
        w = make(qt, n, k)
        variants.append((name, "as in the file", w, int(qt), 0, n, k))
        if qt == Q.Q5_0:
            variants.append((name, "widened to Q8_0", ops.gguf_q5_0_to_q8_0(w), int(Q.Q8_0), 0, n, k))
    best: dict = {}
    for _ in range(args.reps):
        for name, label, w, qt, impl, n, k in variants:
            x = torch.randn(1, k)
            out = torch.empty(1, n)
            for _ in range(3):
                ops.gguf_linear(out, x, [w], [qt], None, impl)
            t = time.thread_time()
            for _ in range(30):
                ops.gguf_linear(out, x, [w], [qt], None, impl)
            dt = (time.thread_time() - t) / 30
            best[(name, label)] = min(best.get((name, label), 1e9), dt)
    print(f"threads {args.threads}; {_load()}")
    print("| product [N x K] | variant | us | ns / weight |")
    print("|---|---|---|---|")
    for (name, label), dt in best.items():
        n, k = next((c[2], c[3]) for c in cases if c[0] == name)
        print(f"| {name} [{n} x {k}] | {label} | {dt * 1e6:.1f} | {dt * 1e9 / (n * k):.3f} |")


def _load():
    with open("/proc/loadavg") as f:
        return "load " + " ".join(f.read().split()[:3])


if __name__ == "__main__":
    main()
