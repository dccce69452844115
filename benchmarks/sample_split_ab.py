"""The one-kernel sampler at many rows, temperature alone (the nano-vllm protocol's sampling), A/B: the logits
as the LM head writes them (bf16) or widened to float32 first (what Sampler.forward did), one program per row or
each row split over programs (`_sample_split`, PER_SM programs per SM in all). Device us per call, CUDA events,
median of --repeats; the widening's own cost too.

    python benchmarks/sample_split_ab.py [--rows 32 64 128 256 512] [--per-sm 2 4 8 16]"""
from __future__ import annotations

import argparse
import statistics


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--per-sm", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    import torch

    from pagedllm.kernels import sampling as ks

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return statistics.median(times)

    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in args.rows:
        logits = (torch.randn(n, args.vocab, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        temp = torch.full((n,), 0.6, device="cuda")
        out = torch.empty(n, dtype=torch.int64, device="cuda")
        seed = 1 << 40
        cols = [f"float() {timed(lambda: logits.float()):7.1f}"]
        wide = logits.float()
        one = ks._sample_launch
        for name, x in (("fp32", wide), ("bf16", logits)):
            def run_one(x=x):
                one[(n,)](x, x.stride(0), args.vocab, temp, out, seed, temp, out, temp, temp, out, 0, 1e-5,
                          BLOCK=ks.LAUNCH[-1][1] if n > ks.LAUNCH[0][0] else ks.LAUNCH[0][1], GROUP=ks.GROUP,
                          num_warps=ks.LAUNCH[-1][2] if n > ks.LAUNCH[0][0] else ks.LAUNCH[0][2])
            cols.append(f"one/{name} {timed(run_one):7.1f}")
        ref = out.clone()
        for per_sm in args.per_sm:
            cols.append(f"split{per_sm}/bf16 "
                        f"{timed(lambda: ks._sample_split(logits, temp, seed, None, 1e-5, out, per_sm)):7.1f}")
            assert torch.equal(out, ref), "the split draw differs from the one-program kernel's"
        print(f"rows {n:4d}: " + "  ".join(cols), flush=True)


if __name__ == "__main__":
    main()
