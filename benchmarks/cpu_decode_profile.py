"""Where does a batch-1 CPU decode step go? One stream of SmolLM2 (the bundled GGUF, packed by default), a
128-token prompt, then N decode steps timed three ways: the whole engine step, the model forward, and the LM
head's greedy pick (the rest is the engine loop: scheduling, input prep, output processing).
With --profile it also prints the torch profiler's top ops for a few steps (op counts show dispatch overhead).

    python benchmarks/cpu_decode_profile.py --steps 64 [--batch 8] [--quantization none] [--threads 2] [--profile]
        [--model FILE.gguf] [--layer-path]

The LM head is timed as "greedy" (the argmax shortcut) plus "logits" (compute_logits: the full logits, what a
packed GGUF LM head takes). --layer-path turns the fused CPU decode stack off (each layer from Python).
"""
from __future__ import annotations

import argparse
import random
import time


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="streams decoding together")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--layer-path", action="store_true", help="the fused CPU decode stack off")
    args = p.parse_args()
    import pagedllm  # noqa: F401  before torch: pagedllm's OpenMP wait policy applies when torch's libgomp loads
    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.core.engine_core import EngineCoreRequest
    from pagedllm.models.loader import resolve_model_path

    torch.set_num_threads(args.threads)
    llm = LLM(model=resolve_model_path(args.model), quantization=args.quantization, max_model_len=1024,
              kv_cache_memory_bytes=256 << 20, skip_tokenizer_init=True)
    engine = llm.engine
    runner = engine.engine_core.executor.worker.model_runner if hasattr(engine, "engine_core") else None
    model = _find_model(engine)
    timers = {"forward": [], "greedy": [], "logits": []}
    orig_forward = model.forward
    orig_greedy = getattr(model, "greedy_token_ids", None)
    orig_logits = model.compute_logits
    if args.layer_path:
        model.model.fast_path = None

    def timed_forward(*a, **kw):
        t0 = time.perf_counter()
        out = orig_forward(*a, **kw)
        timers["forward"].append(time.perf_counter() - t0)
        return out

    def timed_greedy(*a, **kw):
        t0 = time.perf_counter()
        out = orig_greedy(*a, **kw)
        timers["greedy"].append(time.perf_counter() - t0)
        return out

    def timed_logits(*a, **kw):
        t0 = time.perf_counter()
        out = orig_logits(*a, **kw)
        timers["logits"].append(time.perf_counter() - t0)
        return out

    model.forward = timed_forward
    model.compute_logits = timed_logits
    if orig_greedy is not None:
        model.greedy_token_ids = timed_greedy
    del runner
    rng = random.Random(0)
    prompt = [rng.randrange(10, 30000) for _ in range(args.input_len)]
    from pagedllm.core.engine_core import objects_frozen
    with objects_frozen():  # as LLM.generate runs its loop: start-up objects out of the collector's walks
        _rounds(args, engine, model, timers, prompt, EngineCoreRequest, SamplingParams, torch)


def _rounds(args, engine, model, timers, prompt, EngineCoreRequest, SamplingParams, torch):
    for rnd in range(2):
        engine.reset_prefix_cache()
        for b in range(args.batch):
            engine.add_request(EngineCoreRequest(f"r{rnd}-{b}", prompt[b:] + prompt[:b],
                                                 SamplingParams(temperature=0.0, max_tokens=args.steps + 1,
                                                                ignore_eos=True)))
        engine.step()  # prefill
        for t in timers.values():
            t.clear()
        steps = []
        cpu0 = time.process_time()
        prof = None
        if args.profile and rnd == 1:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
        if prof is not None:
            prof.__exit__(None, None, None)
        n = len(steps)
        ms = lambda xs: 1e3 * sorted(xs)[len(xs) // 2] if xs else 0.0  # noqa: E731
        head = ms(timers['greedy']) + ms(timers['logits'])
        print(f"round {rnd}: {n} decode steps; median ms: step {ms(steps):.2f}, forward {ms(timers['forward']):.2f}, "
              f"greedy {ms(timers['greedy']):.2f}, logits {ms(timers['logits']):.2f}, "
              f"rest {ms(steps) - ms(timers['forward']) - head:.2f}"
              f"; process CPU ms/step {1e3 * cpu / n:.2f}; {args.batch * n / sum(steps):.1f} tok/s; "
              f"{_load()}", flush=True)
        if prof is not None:
            events = prof.key_averages()
            print(f"torch ops per step: {sum(e.count for e in events) / n:.0f}")
            print(events.table(sort_by="self_cpu_time_total", row_limit=25))


def _load():
    with open("/proc/loadavg") as f:
        return "load " + " ".join(f.read().split()[:3])


def _find_model(engine):
    """The in-process model (uniproc executor)."""
    seen = set()
    stack = [engine]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        model = getattr(obj, "model", None)
        if model is not None and hasattr(model, "compute_logits"):
            return model
        for name in ("engine_core", "core", "executor", "worker", "driver_worker", "model_runner", "runner"):
            child = getattr(obj, name, None)
            if child is not None:
                stack.append(child)
    raise RuntimeError("could not find the model in this engine (is it in-process?)")


if __name__ == "__main__":
    main()
