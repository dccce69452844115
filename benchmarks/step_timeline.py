"""Where an offline run's time goes, step by step: wall time per engine step grouped by how many requests
were running, split into host phases (schedule, launch, apply results) and time waiting on the device.

    python benchmarks/step_timeline.py --model benchmarks/configs/qwen3-0.6b --load-format dummy \\
        --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --max-model-len 2048

Same workload as offline_throughput.py. With async scheduling (the CUDA default) a step whose host phases add
up to about its wall time is host-bound: the device finished the previous step and waited for the host.
A step with a large "wait" is device-bound.

On CUDA it also times the device: "device" is the span from the start of a step's first enqueued work to the end
of its last (CUDA events around the launch), "idle" the time the device sat waiting for the host before the step's
work began. Steps with large idle are host-bound.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline_throughput import make_requests  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 160])
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 160])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    args = p.parse_args(argv)

    from pagedllm import LLM, SamplingParams
    from pagedllm.core.engine_core import EngineCoreRequest

    kwargs = dict(model=args.model, load_format=args.load_format, skip_tokenizer_init=True,
                  max_num_seqs=args.max_num_seqs)
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    llm = LLM(**kwargs)
    eng = llm.engine
    vocab = eng.worker.hf_config.vocab_size
    reqs = make_requests(args.num_prompts, args.input_len, args.output_len, min(vocab, 32000), 0)
    llm.generate([{"prompt_token_ids": ids} for ids, _ in reqs[:2]],
                 [SamplingParams(max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)  # warm-up
    eng.reset_prefix_cache()  # no prefix hits from the warm-up

    phases = defaultdict(float)
    wrapped = {}

    def timed(obj, name, key):
        fn = getattr(obj, name)
        wrapped[(obj, name)] = fn

        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[key] += time.perf_counter() - t0
        setattr(obj, name, inner)

    timed(eng.scheduler, "schedule", "schedule")
    timed(eng.scheduler, "update_from_output", "apply")
    timed(eng.worker, "launch", "launch")
    events = []  # (bucket, start event, end event) per launch, CUDA only
    if torch.cuda.is_available():
        launch = eng.worker.launch

        def launch_with_events(*a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return launch(*a, **k)
            finally:
                end.record()
                events.append((current_bucket, start, end))
        eng.worker.launch = launch_with_events
    current_bucket = 1
    for i, (ids, n) in enumerate(reqs):
        eng.add_request(EngineCoreRequest(f"t{i}", ids, SamplingParams(max_tokens=n, ignore_eos=True)))
    buckets = defaultdict(lambda: defaultdict(float))  # running-count bucket -> totals
    t_start = time.perf_counter()
    tokens = 0
    while eng.scheduler.num_waiting or eng.scheduler.running or getattr(eng, "_in_flight", None) is not None:
        running = len(eng.scheduler.running)
        # Set before the step, so the launch inside it records this step's bucket with its events.
        b = current_bucket = 1 << max(0, (max(running, 1) - 1).bit_length())  # 1, 2, 4, ..., 256
        phases.clear()
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        tokens += sum(len(o.new_token_ids) for o in outs)
        acc = buckets[b]
        acc["steps"] += 1
        acc["wall"] += dt
        for k, v in phases.items():
            acc[k] += v
    total = time.perf_counter() - t_start
    if events:
        torch.cuda.synchronize()
        print("device ms of the first steps:", " ".join(f"{s.elapsed_time(e):.1f}" for _, s, e in events[:4]))
        for i, (b, start, end) in enumerate(events):
            buckets[b]["device"] += start.elapsed_time(end) / 1e3
            if i:
                buckets[b]["idle"] += max(0.0, events[i - 1][2].elapsed_time(start) / 1e3)
    print(f"{tokens} output tokens in {total:.2f} s = {tokens / total:.0f} tok/s")
    print(f"{'running<=':>9} {'steps':>6} {'wall ms/step':>12} {'schedule':>9} {'launch':>8} {'apply':>8} "
          f"{'other':>8} {'share of run':>12} {'device':>8} {'idle':>8}")
    for b in sorted(buckets):
        a = buckets[b]
        n = a["steps"]
        other = a["wall"] - a["schedule"] - a["launch"] - a["apply"]
        print(f"{b:>9} {int(n):>6} {a['wall'] / n * 1e3:>12.2f} {a['schedule'] / n * 1e3:>9.2f} "
              f"{a['launch'] / n * 1e3:>8.2f} {a['apply'] / n * 1e3:>8.2f} {other / n * 1e3:>8.2f} "
              f"{a['wall'] / total * 100:>11.0f}% {a['device'] / n * 1e3:>8.2f} {a['idle'] / n * 1e3:>8.2f}")


if __name__ == "__main__":
    main()
