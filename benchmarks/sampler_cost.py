"""The sampler's cost per step at 1 / 64 / 256 rows x a Qwen-sized vocabulary (151,936), alone and as the whole
sampler step (temperature, min_p, the filters, softmax, the draw), for each way of applying top-k / top-p
(layers/top_k_top_p.py) in the general path: `sort` (the reference), `cutoff` (the per-row bucket search, the
CPU's default), `prefix` (each row's 1024 largest logits by torch.topk, or the batch's largest top-k, and the sort
for the rows they cannot settle); and on CUDA `device`, the one-kernel sampler (kernels/sampling.py, CUDA's default:
its step only, it has no separate filter; `kernel`: its one-program variant even where CUDA splits a few plain rows).

    python benchmarks/sampler_cost.py [--device cpu|cuda] [--rows 1,64,256] [--vocab 151936] [--logits llm,normal]
                                      [--configs ...] [--impls sort,cutoff,prefix,device] [--repeats N] [--warmup N]
                                      [--json out.json]

Configurations (every row the same parameters): `temp` (temperature 0.6 only: no filter, the floor of a step),
`top_p` (0.6 / top_p 0.9), `qwen` (0.6 / top_k 20 / top_p 0.95: Qwen3's recommended sampling), `min_p` (1.0 /
min_p 0.05 / top_p 0.9), `top_k_large` (1.0 / top_k 5000). Logits: `llm` (a normal body with std 2 and eight
tokens lifted by up to 12 nats, as a language model's row looks), `normal` (randn x 2: flat, the search's harder
case and the sort's same case). Timing: CUDA events on CUDA (after `--warmup` calls, which compile the kernels),
time.perf_counter on the CPU; each call gets a fresh copy of the logits (the sampler works in place), made outside
the timed region; the table gives the median of `--repeats`. Prints a table and writes JSON (default
sampler_cost.json in the current directory).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

import pagedllm  # noqa: E402,F401  (before torch: its OpenMP wait policy)
import torch  # noqa: E402

from pagedllm.layers import sampler as sampler_mod  # noqa: E402
from pagedllm.layers.sampler import Sampler, SamplingMetadata, apply_top_k_only, apply_top_k_top_p_sort  # noqa: E402
from pagedllm.layers.top_k_top_p import apply_top_k_top_p, apply_top_k_top_p_prefix  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

CONFIGS = {
    "temp": dict(temperature=0.6),
    "top_p": dict(temperature=0.6, top_p=0.9),
    "qwen": dict(temperature=0.6, top_k=20, top_p=0.95),
    "min_p": dict(temperature=1.0, min_p=0.05, top_p=0.9),
    "top_k_large": dict(temperature=1.0, top_k=5000),
}


def make_logits(rows: int, vocab: int, kind: str, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, vocab, generator=gen) * 2.0
    if kind == "llm":
        top = torch.randint(0, vocab, (rows, 8), generator=gen)
        x.scatter_add_(1, top, torch.rand(rows, 8, generator=gen) * 12.0)
    return x.to(device)


def timed(fn, base: torch.Tensor, repeats: int, warmup: int) -> list[float]:
    """Milliseconds of fn(copy of base), each call on a fresh copy made outside the timed region."""
    cuda = base.is_cuda
    out = []
    for i in range(warmup + repeats):
        x = base.clone()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t = time.perf_counter()
            fn(x)
            ms = (time.perf_counter() - t) * 1e3
        if i >= warmup:
            out.append(ms)
    return out


def filter_fn(meta: SamplingMetadata, impl: str):
    """Top-k / top-p alone, on logits already divided by the temperature (min_p not included)."""
    top_k = None if meta.no_top_k else meta.top_k
    top_p = None if meta.no_top_p else meta.top_p
    if impl == "sort":
        if top_p is not None:
            return lambda x: apply_top_k_top_p_sort(x, top_k, top_p)
        return lambda x: apply_top_k_only(x, top_k, meta.max_top_k)
    if impl == "prefix":
        return lambda x: apply_top_k_top_p_prefix(x, top_k, top_p, meta.max_top_k, meta.top_p_within_top_k)
    return lambda x: apply_top_k_top_p(x, top_k, top_p)


def step_fn(meta: SamplingMetadata, impl: str):
    def run(x):
        # "device": CUDA's default (the one-kernel sampler, kernels/sampling.py, its split variant for a few plain
        # rows); "kernel": the one-program kernel whatever the batch; the others: the general path
        from pagedllm.kernels import sampling as kernel

        sampler_mod.TOP_K_TOP_P_IMPL = "auto" if impl in ("device", "kernel") else impl
        sampler_mod.DEVICE_SAMPLING = impl in ("device", "kernel")
        split_max = kernel.SPLIT_MAX_ROWS
        if impl == "kernel":
            kernel.SPLIT_MAX_ROWS = 0
        try:
            return Sampler()(x, meta).sampled_token_ids
        finally:
            sampler_mod.TOP_K_TOP_P_IMPL = "auto"
            sampler_mod.DEVICE_SAMPLING = True
            kernel.SPLIT_MAX_ROWS = split_max
    return run


def cases(args):
    """(logits kind, rows, config name, logits, metadata) for every combination the arguments name."""
    for kind in args.logits.split(","):
        for rows in [int(r) for r in args.rows.split(",")]:
            base = make_logits(rows, args.vocab, kind, args.device)
            for name in args.configs.split(","):
                params = [SamplingParams(**CONFIGS[name])] * rows
                meta = SamplingMetadata.build(params, [[]] * rows, [[]] * rows, [None] * rows, args.vocab,
                                              args.device)
                yield kind, rows, name, base, meta


def sweep(args, repeats: int, warmup: int) -> None:
    """The device sampler's step (kernels/sampling.py) at each launch shape of --sweep: ms per config and rows."""
    from pagedllm.kernels import sampling as kernel

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.sweep.split(",")]
    results = []
    print(f"{'logits':7} {'config':12} {'rows':>5} " + " ".join(f"{f'{b}x{w} ms':>11}" for b, w in shapes))
    for kind, rows, name, base, meta in cases(args):
        cells = []
        default_launch = kernel.LAUNCH
        for block, warps in shapes:
            kernel.LAUNCH = ((1 << 30, block, warps),)
            ms = statistics.median(timed(step_fn(meta, "kernel"), base, repeats, warmup))
            results.append({"logits": kind, "config": name, "rows": rows, "block": block, "warps": warps,
                            "median_ms": ms})
            cells.append(f"{ms:11.3f}")
            kernel.LAUNCH = default_launch
        print(f"{kind:7} {name:12} {rows:5d} " + " ".join(cells), flush=True)
    with open(args.json, "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "commit": git_commit(), "vocab": args.vocab, "sweep": results}, f, indent=1)
    print(f"wrote {args.json}")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", default="1,64,256")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--logits", default="llm,normal")
    parser.add_argument("--configs", default="temp,top_p,qwen,min_p,top_k_large")
    parser.add_argument("--parts", default="filter,step", help="filter: top-k / top-p alone; step: the whole sampler")
    parser.add_argument("--repeats", type=int, default=None, help="default 20 on CUDA, 3 on the CPU")
    parser.add_argument("--warmup", type=int, default=None, help="default 5 on CUDA, 1 on the CPU")
    parser.add_argument("--impls", default=None,
                        help="sort (the general path's reference, first), cutoff (the bucket search), prefix "
                             "(torch.topk's 1024 largest per row, the sort for rows they cannot settle), device (the "
                             "one-kernel sampler as CUDA runs it, CUDA only), kernel (its one-program variant for every batch); "
                             "default "
                             "sort,cutoff,prefix and on CUDA also device")
    parser.add_argument("--sweep", default=None, metavar="BLOCKxWARPS,...",
                        help="time only the device sampler's step, once per launch shape (e.g. 1024x4,2048x8)")
    parser.add_argument("--json", default="sampler_cost.json")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    repeats = args.repeats or (20 if cuda else 3)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)

    if args.sweep:
        sweep(args, repeats, warmup)
        return
    results = []
    impls = (args.impls or ("sort,cutoff,prefix,device" if cuda else "sort,cutoff,prefix")).split(",")
    if impls[0] != "sort" or not set(impls) <= {"sort", "cutoff", "prefix", "device", "kernel"}:
        parser.error("--impls: sort first, then any of cutoff, prefix, device, kernel")
    if {"device", "kernel"} & set(impls) and not cuda:
        parser.error("--impls device: the device sampler runs on CUDA")
    header = f"{'logits':7} {'config':12} {'rows':>5} {'part':7} " + " ".join(
        f"{i + ' ms':>10}" + ("" if i == "sort" else f" {'x sort':>7}") for i in impls)
    print(header)
    print("-" * len(header))
    for kind, rows, name, base, meta in cases(args):
        for part in args.parts.split(","):
            if part == "filter" and meta.no_top_k and meta.no_top_p:
                continue
            scaled = base / CONFIGS[name]["temperature"] if part == "filter" else base
            row = {"logits": kind, "config": name, "rows": rows, "part": part}
            for impl in impls:
                if part == "filter" and impl in ("device", "kernel"):  # the kernel has no filter part
                    continue
                fn = (filter_fn if part == "filter" else step_fn)(meta, impl)
                ms = timed(fn, scaled, repeats, warmup)
                row[impl] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "all_ms": ms}
            results.append(row)
            s = row["sort"]["median_ms"]
            cells = " ".join((f"{row[i]['median_ms']:10.3f}" + (
                "" if i == "sort" else f" {s / row[i]['median_ms']:6.2f}x")) if i in row
                else f"{'-':>10}" + ("" if i == "sort" else f" {'':7}") for i in impls)
            print(f"{kind:7} {name:12} {rows:5d} {part:7} {cells}", flush=True)

    machine = {"device": args.device, "torch": torch.__version__, "python": platform.python_version(),
               "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None}
    if cuda:
        machine["gpu"] = torch.cuda.get_device_name()
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "vocab": args.vocab, "repeats": repeats, "warmup": warmup,
           "machine": machine, "results": results}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
