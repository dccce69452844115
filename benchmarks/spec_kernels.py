"""Device time of the overlapped-speculation kernels (kernels/spec_decode.py) per launch, on CUDA: the n-gram
proposal of `spec_step_outputs` after a plain step (one row per request, proposing), for history lengths and
three kinds of history (docs/benchmarks.md has the one-pass scan beside the per-n scan it replaced).

    python benchmarks/spec_kernels.py [--lengths 128 512 2048] [--batch 1 4] [--k 8] [--lookup 2 4]

Histories: "near" (the suffix's 4-gram also ends just before it: the scan's first chunk finds it), "far" (a 4-gram
match only at the start), "none" (no earlier 2-gram equals the suffix's: the whole history is scanned).
Each row is the mean over a CUDA graph of --calls launches back to back (the lengths restored before each replay),
so the device time is measured without the host's launch cost; the launches of a step run outside the graphs, where
the host's ~20 us per launch comes on top (benchmarks/launch_costs.py).
"""
from __future__ import annotations

import argparse
import json

import torch


def history(kind: str, length: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [length] token ids ending in the suffix 1, 2, 3, 4, matched earlier as `kind` says (random ids are
    >= 10: they never equal the suffix's)."""
    if kind == "none":  # strictly increasing ids: no 2-gram repeats
        toks = torch.arange(length, dtype=torch.int32) + 10
        toks[-1] = 5
        return toks
    toks = torch.randint(10, 100_000, (length,), generator=gen, dtype=torch.int32)
    suffix = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    toks[-4:] = suffix
    at = length - 12 if kind == "near" else 0
    toks[at:at + 4] = suffix
    return toks


def time_kernel(args, kind: str, length: int, batch: int) -> float:
    from pagedllm.kernels.spec_decode import spec_step_outputs
    from pagedllm.spec_decode.device_ngram import DeviceNgram

    dev = torch.device("cuda")
    h = history(kind, length, torch.Generator().manual_seed(length))
    # Each launch of the graph has rows of its own, holding the history but its last token, which the launch
    # appends (as after a plain step): every launch sees the same state and proposes the same drafts.
    ngram = DeviceNgram(batch * args.calls, length + 8, args.k, args.lookup[0], args.lookup[1], dev)
    ngram.hist[:, :length - 1] = h[:-1].to(dev)
    ngram.lens.fill_(length - 1)
    lens0 = ngram.lens.clone()
    final = torch.full((batch,), int(h[-1]), dtype=torch.int64, device=dev)
    starts = torch.arange(batch, dtype=torch.int64, device=dev)
    counts = torch.ones(batch, dtype=torch.int64, device=dev)
    rows = [starts + c * batch for c in range(args.calls)]
    out = torch.empty((5, batch + batch % 2), dtype=torch.int64, device=dev)[:, :batch]

    def call(c: int) -> None:
        spec_step_outputs(rows[c], starts, counts, final, ngram.hist, ngram.lens, ngram.drafts, ngram.num_drafts,
                          ngram.min_n, ngram.max_n, True, out=out)

    call(0)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ngram.lens.copy_(lens0)  # (one copy for every launch's rows)
        for c in range(args.calls):
            call(c)
    graph.replay()
    torch.cuda.synchronize()
    want = {"near": length - 8, "far": 4, "none": 0}[kind]  # the draft start the lookup must find
    got = int(ngram.num_drafts[0])
    if (got > 0) != (kind != "none") or (got and int(ngram.drafts[0, 0]) != int(h[want])):
        raise SystemExit(f"spec_kernels.py: {kind} history of {length}: unexpected proposal ({got} drafts)")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(args.iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / args.calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--kinds", nargs="+", default=["near", "far", "none"], choices=["near", "far", "none"])
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"))
    p.add_argument("--calls", type=int, default=100, help="launches per graph replay")
    p.add_argument("--iters", type=int, default=7, help="replays timed (the median is the row)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("spec_kernels.py times CUDA kernels: it needs a CUDA device")
    rows = []
    print(f"spec_step_outputs after a plain step, k={args.k}, lookup {args.lookup[0]}..{args.lookup[1]}: device us "
          f"per launch")
    for batch in args.batch:
        for kind in args.kinds:
            for length in args.lengths:
                us = time_kernel(args, kind, length, batch)
                rows.append(dict(batch=batch, kind=kind, length=length, us=us))
                print(f"  batch {batch:3d}  {kind:5s} history {length:6d}: {us:8.2f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
