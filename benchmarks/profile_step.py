"""Where does one engine step's time go? Schedules N requests into steady-state decode, then times
schedule / execute / update per step and prints the torch profiler's top ops (CPU and CUDA).

    python benchmarks/profile_step.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --batch 256

With --prefill it profiles one full prefill step instead: --batch prompts of U(100..1024) tokens (seed 0), after
one such step as a warm-up; the step takes as many prompt tokens as the step budget allows.
"""
from __future__ import annotations

import argparse
import random
import time

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--prefill", action="store_true", help="profile one prefill step instead of decode steps")
    args = p.parse_args()
    from pagedllm import LLM, SamplingParams
    from pagedllm.core.engine_core import EngineCoreRequest

    llm = LLM(model=args.model, load_format=args.load_format, skip_tokenizer_init=True, max_num_seqs=args.batch,
              enforce_eager=args.enforce_eager, max_model_len=args.max_model_len)
    eng = llm.engine
    rng = random.Random(0)
    if args.prefill:
        return profile_prefill(eng, args.batch, rng)
    for i in range(args.batch):
        ids = [rng.randrange(10, 30000) for _ in range(args.input_len)]
        eng.add_request(EngineCoreRequest(f"r{i}", ids, SamplingParams(max_tokens=1000, ignore_eos=True)))
    while eng.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sched = execute = update = 0.0
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        plan = eng.scheduler.schedule()
        t1 = time.perf_counter()
        out = eng.worker.execute_model(plan)
        t2 = time.perf_counter()
        eng.scheduler.update_from_output(plan, out)
        t3 = time.perf_counter()
        sched += t1 - t0
        execute += t2 - t1
        update += t3 - t2
    total = time.perf_counter() - start
    n = args.steps
    print(f"batch {args.batch}: {total / n * 1e3:.2f} ms/step = {args.batch * n / total:.0f} tok/s; "
          f"schedule {sched / n * 1e3:.2f} ms, execute {execute / n * 1e3:.2f} ms, update {update / n * 1e3:.2f} ms")
    profiled(eng, steps=5)


def profiled(eng, steps: int) -> float:
    """Run `steps` engine steps under the torch profiler (CPU, and CUDA when present), print its top ops by
    device time (CPU time without a GPU), and return the wall seconds of the profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        elapsed = time.perf_counter() - t0
    print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=25))
    return elapsed


def profile_prefill(eng, num_prompts: int, rng: random.Random) -> None:
    from pagedllm import SamplingParams
    from pagedllm.core.engine_core import EngineCoreRequest

    def add(tag):
        for i in range(num_prompts):
            ids = [rng.randrange(10, 30000) for _ in range(rng.randint(100, 1024))]
            eng.add_request(EngineCoreRequest(f"{tag}{i}", ids, SamplingParams(max_tokens=1, ignore_eos=True)))

    add("warm")
    while eng.has_unfinished_requests():
        eng.step()
    add("p")
    plans = []
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    elapsed = profiled(eng, steps=1)
    eng.scheduler.schedule = schedule
    print(f"one prefill step: {plans[0].total_num_scheduled_tokens} prompt tokens in {elapsed * 1e3:.1f} ms "
          "(wall, profiled)")
    while eng.has_unfinished_requests():
        eng.step()


if __name__ == "__main__":
    main()
