"""Where is the GPU idle during decode steps? Runs N requests into steady-state decode, records a few engine
steps under the torch profiler, and reports per step: the span of GPU activity, the time some kernel or copy was
running (union of intervals), the idle rest, and which neighbouring activities the largest gaps sit between.

    python benchmarks/device_idle.py --model benchmarks/configs/llama3-8b --load-format dummy --batch 1
    python benchmarks/device_idle.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --batch 256

The profiler slows the host, so gaps at step boundaries (host-bound) come out larger than in a plain run; the
gaps between kernels inside a CUDA graph are device-side and are not inflated. Greedy sampling (--temperature to sample), ignore_eos;
--trace keeps the profiler's trace, --with-stack with the host's Python stacks.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections import defaultdict


def gpu_intervals(trace_path: str) -> list[dict]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(gpu, key=lambda e: e["ts"])


def busy_us(gpu: list[dict]) -> float:
    """Microseconds some kernel or copy was running (the union of the intervals, sorted by start)."""
    busy, end = 0.0, gpu[0]["ts"] if gpu else 0.0
    for e in gpu:
        start, dur = e["ts"], e["dur"]
        if start + dur > end:
            busy += start + dur - max(start, end)
            end = start + dur
    return busy


def idle_report(gpu: list[dict], steps: int, top: int = 12) -> str:
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    busy, end, prev = 0.0, gpu[0]["ts"], None
    gaps: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        start, dur = e["ts"], e["dur"]
        if start > end and prev is not None:
            g = gaps[(prev["name"][:48], e["name"][:48])]
            g[0] += 1
            g[1] += start - end
        if start + dur > end:
            busy += start + dur - max(start, end)
            end = start + dur
        prev = e
    lines = [f"per step: span {span / steps:.0f} us, busy {busy / steps:.0f} us, idle {(span - busy) / steps:.0f} us, "
             f"{sum(n for n, _ in gaps.values()) / steps:.0f} gaps",
             "largest gaps (us per step, gaps per step, previous -> next activity):"]
    for (a, b), (n, total) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {total / steps:8.1f}  x{n / steps:6.1f}  {a}  ->  {b}")
    return "\n".join(lines)


def host_waits(trace_path: str, steps: int, min_us: float = 50.0, top: int = 12) -> str:
    """The host's CUDA runtime / driver calls by total time per step, and the torch ops around the long ones: a
    call that waits for the device (a synchronize, a pageable copy, an allocation that syncs) inside a step's
    launch is what leaves the device idle at the next step boundary."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    calls = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    ops = sorted((e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation")),
                 key=lambda e: (e["ts"], -e["dur"]))
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    around: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for c in calls:
        agg = by_name[c["name"]]
        agg[0] += 1
        agg[1] += c["dur"]
        agg[2] = max(agg[2], c["dur"])
        if c["dur"] >= min_us:
            # the innermost op on the same thread that contains the call
            inner = None
            for o in ops:
                if o["ts"] > c["ts"]:
                    break
                if o.get("tid") == c.get("tid") and o["ts"] + o["dur"] >= c["ts"] + c["dur"]:
                    inner = o
            key = (c["name"], inner["name"][:60] if inner else "-")
            around[key][0] += 1
            around[key][1] += c["dur"]
    lines = ["host CUDA calls (us per step, calls per step, longest us):"]
    for name, (n, total, longest) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {total / steps:8.1f}  x{n / steps:6.1f}  max {longest:8.1f}  {name}")
    lines.append(f"calls of >= {min_us:.0f} us, by the op around them (us per step, calls per step):")
    for (name, op), (n, total) in sorted(around.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {total / steps:8.1f}  x{n / steps:6.1f}  {name}  in  {op}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--trace", default=None, help="also keep the chrome trace here (.json.gz: gzipped)")
    p.add_argument("--with-stack", action="store_true", help="record Python stacks (for where the host waits)")
    args = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import LLM, SamplingParams
    from pagedllm.core.engine_core import EngineCoreRequest

    if not torch.cuda.is_available():
        raise SystemExit("device_idle.py measures GPU idle time; it needs a CUDA GPU")
    llm = LLM(model=args.model, load_format=args.load_format, skip_tokenizer_init=True,
              max_num_seqs=max(args.batch, 8), max_model_len=args.max_model_len)
    eng = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.max_model_len - args.input_len, ignore_eos=True,
                            temperature=args.temperature)
    for i in range(args.batch):
        eng.add_request(EngineCoreRequest(f"r{i}", [rng.randrange(10, 30000) for _ in range(args.input_len)], params))
    while eng.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    print(f"batch {args.batch}: {(time.perf_counter() - start) / 20 * 1e3:.2f} ms/step without the profiler")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.with_stack) as prof:
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        print(idle_report(gpu_intervals(path), args.steps))
        print(host_waits(path, args.steps))
        if args.trace:
            import gzip
            import shutil

            with open(path, "rb") as src, (gzip.open if args.trace.endswith(".gz") else open)(args.trace, "wb") as dst:
                shutil.copyfileobj(src, dst)


if __name__ == "__main__":
    main()
