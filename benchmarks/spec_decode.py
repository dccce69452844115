"""Speculative decoding, with vs without, both engines in the same process, runs interleaved (ratios).

    # 1. SmolLM2 (the GGUF) in bf16, batch 1, repeat / edit prompts: tokens/s with n-gram vs without (target >= 2x)
    python benchmarks/spec_decode.py ngram --model SmolLM2-135M-Instruct.Q4_1.gguf --dtype bfloat16
    # 2. Llama-3-8B shape: one verify step of k=4 at batch 1 vs one plain decode step (target <= 1.15x)
    python benchmarks/spec_decode.py verify --model benchmarks/configs/llama3-8b --load-format dummy
    #    + --host-profile 50: eager ops and host syncs per plain / verify step, and the host functions a verify
    #      step adds (cProfile); --profile: kernel time per step
    # 3. Qwen3-0.6B shape, batch 64: throughput with speculation configured vs without (target >= 95%)
    python benchmarks/spec_decode.py batch --model benchmarks/configs/qwen3-0.6b --load-format dummy
    # 4. where speculation stops paying (sets speculative_config's disable_by_batch_size): ratio per batch size,
    #    speculation forced on; on the repeat / edit tasks (a real model) or random prompts (a dummy shape)
    python benchmarks/spec_decode.py sweep --model SmolLM2-135M-Instruct.Q4_1.gguf --dtype bfloat16
    python benchmarks/spec_decode.py sweep --model benchmarks/configs/qwen3-0.6b --load-format dummy \
        --dtype bfloat16 --batch-sizes 1 4 16 32 64 --output-len 128
    # 5. engine steps by kind for the four tasks at batch 1 (exact; in fp32 on the CPU too): without n-gram,
    #    overlapped, waiting, and with k placeholders on every step
    python benchmarks/spec_decode.py steps --model SmolLM2-135M-Instruct.Q4_1.gguf --dtype float32 --async
    # 6. draft-model speculation at batch 1: a draft's shape beside the target's with random weights (step costs:
    #    the speed-up each acceptance rate would give), and the mechanics with SmolLM2 drafting for itself
    python benchmarks/spec_decode.py draft --model benchmarks/configs/llama3-8b \
        --draft-model benchmarks/configs/llama3.2-1b --load-format dummy --dtype bfloat16
    python benchmarks/spec_decode.py draft --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --draft-model SmolLM2-135M-Instruct.Q4_1.gguf --dtype bfloat16

Each prints one line per measurement and a final ratio; --json FILE writes them too.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import time
from typing import Optional

TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
        "members agreed to increase spending on public transport, to keep the library open on Sundays, and to "
        "plant two hundred new trees along the river. The final vote was seven to two.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
TASKS = [f"Repeat the following text exactly, word for word:\n\n{TEXT}",
         f"Rewrite this Python code, renaming the function total_price to compute_total. Output only the code.\n\n{CODE}",
         f"Copy this code and add a docstring to each function:\n\n{CODE}",
         f"Correct the spelling in this text and repeat it:\n\n{TEXT.replace('committee', 'comittee')}"]

MODULE = '''import json
import os


class Settings:
    def __init__(self, path):
        self.path = path
        self.values = {}

    def load(self):
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.values = json.load(f)
        return self.values

    def get(self, key, default=None):
        return self.values.get(key, default)

    def set(self, key, value):
        self.values[key] = value
        with open(self.path, "w") as f:
            json.dump(self.values, f, indent=2)
'''
CONFIG = '''{
  "server": {"host": "127.0.0.1", "port": 8000, "workers": 4},
  "database": {"url": "postgres://localhost/app", "pool_size": 10, "timeout_s": 30},
  "logging": {"level": "INFO", "file": "/var/log/app.log"}
}
'''
# Code editing, the case speculation by n-grams is for: the answer is mostly the prompt's code with a few changes.
CODE_TASKS = [f"Add type hints to every method of this class. Output the whole module.\n\n{MODULE}",
              f"Rename the class Settings to AppSettings. Output the whole module, nothing else.\n\n{MODULE}",
              f"Change the server port to 8080 and the log level to DEBUG. Output the whole JSON.\n\n{CONFIG}",
              f"Add a docstring to each function, then output the code.\n\n{CODE}"]
TASK_SETS = {"edit": TASKS, "code": CODE_TASKS}


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_llm(args, spec: dict | None):
    from pagedllm import LLM

    kw = dict(model=args.model, load_format=args.load_format, dtype=args.dtype,
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
              max_num_seqs=max(args.batch_size, 8), seed=0)
    if args.load_format == "dummy":
        kw["skip_tokenizer_init"] = True
    if args.no_async:
        kw["async_scheduling"] = False
    elif args.async_scheduling:
        kw["async_scheduling"] = True
    return LLM(speculative_config=spec, **kw)


def ngram_config(args) -> dict:
    c = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": getattr(args, "lookup_max", 4),
         "prompt_lookup_min": getattr(args, "lookup_min", 1)}
    if args.disable_by_batch_size is not None:
        c["disable_by_batch_size"] = None if args.disable_by_batch_size <= 0 else args.disable_by_batch_size
    return c


def chat_prompts(llm, n: int, tasks: str = "edit") -> list[dict]:
    """n chat prompts cycling through a task set (TASK_SETS: the repeat / edit tasks or the code-editing ones)."""
    tok = llm.get_tokenizer()
    texts = TASK_SETS[tasks]
    out = []
    for i in range(n):
        ids = tok.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}], add_generation_prompt=True,
                                      tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
        out.append({"prompt_token_ids": list(ids)})
    return out


def random_prompts(llm, n: int, length: int) -> list[dict]:
    rng = random.Random(0)
    vocab = min(llm.engine.vocab_size, 32000)
    return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(length)]} for _ in range(n)]


def timed_generate(llm, prompts, params, one_by_one: bool = False) -> tuple[float, int]:
    """Wall time and output tokens of the prompts as one batch (or one request at a time: batch 1)."""
    llm.engine.reset_prefix_cache()
    sync()
    start = time.perf_counter()
    groups = [[p] for p in prompts] if one_by_one else [prompts]
    outs = [o for g in groups for o in llm.generate(g, params, use_tqdm=False)]
    sync()
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def compare_throughput(args, prompts_of, params, label: str, engines=None, one_by_one: bool = False) -> dict:
    plain, spec = engines or (make_llm(args, None), make_llm(args, ngram_config(args)))
    prompts = prompts_of(plain)
    timed_generate(plain, prompts, params, one_by_one)  # warm-up (compiles, allocator)
    timed_generate(spec, prompts, params, one_by_one)
    ratios, rows = [], []
    for it in range(args.iters):
        stats = spec.engine.scheduler.spec_stats
        before = (stats.num_draft_tokens, stats.num_accepted_tokens)
        if one_by_one:
            # Request by request, the two engines alternating (which goes first alternates too): a host whose speed
            # drifts during the run (the GPU machine's does) then weighs on both sides alike.
            sums = {id(plain): [0.0, 0], id(spec): [0.0, 0]}  # wall seconds, tokens
            for j, p in enumerate(prompts):
                for llm in ((plain, spec) if (it + j) % 2 == 0 else (spec, plain)):
                    t, n = timed_generate(llm, [p], params)
                    sums[id(llm)][0] += t
                    sums[id(llm)][1] += n
            (t_plain, n_plain), (t_spec, n_spec) = sums[id(plain)], sums[id(spec)]
        else:
            t_plain, n_plain = timed_generate(plain, prompts, params)
            t_spec, n_spec = timed_generate(spec, prompts, params)
        drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
        rate = accepted / drafted if drafted else 0.0
        r = (n_spec / t_spec) / (n_plain / t_plain)
        ratios.append(r)
        rows.append(dict(iter=it, plain_tok_s=n_plain / t_plain, spec_tok_s=n_spec / t_spec, ratio=r,
                         acceptance=rate, drafted=drafted))
        print(f"[{label}] iter {it}: without {n_plain / t_plain:9.1f} tok/s ({n_plain} tokens)   with spec "
              f"{n_spec / t_spec:9.1f} tok/s ({n_spec})   ratio {r:.3f}   acceptance {100 * rate:.1f}% of {drafted}")
    med = statistics.median(ratios)
    print(f"[{label}] median ratio with/without: {med:.3f}")
    out = dict(label=label, rows=rows, median_ratio=med)
    if getattr(args, "step_times", False):
        out["step_times"] = {name: step_times(llm, prompts, params, one_by_one, f"{label}, {name}", args.k)
                             for name, llm in (("without", plain), ("with", spec))}
    if getattr(args, "run_profile", False):
        run_profile_diff(plain, spec, prompts, params, one_by_one, label)
    if getattr(args, "device_busy", False):
        out["device_busy"] = device_busy_diff(plain, spec, prompts, params, one_by_one, label)
    return out


def device_busy_diff(plain, spec, prompts, params, one_by_one: bool, label: str, top: int = 15) -> dict:
    """One run of each engine under the torch profiler (device activity only): its wall time against the time the
    GPU ran something (a step whose wall exceeds its device time is host-bound), and the kernels whose total time
    grows most from the plain engine's run to the speculating engine's (us per run)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from device_idle import busy_us, gpu_intervals

    runs = {}
    for name, llm in (("without", plain), ("with", spec)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall, tokens = timed_generate(llm, prompts, params, one_by_one)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            gpu = gpu_intervals(path)
        kernels: dict[str, list[float]] = {}
        for e in gpu:
            k = kernels.setdefault(e["name"][:90], [0, 0.0])
            k[0] += 1
            k[1] += e["dur"]
        busy = busy_us(gpu)
        runs[name] = dict(wall_ms=1e3 * wall, busy_ms=busy / 1e3, tokens=tokens, kernels=kernels)
        print(f"[busy {label}, {name}] {tokens} tokens: wall {1e3 * wall:.1f} ms (with the profiler), GPU busy "
              f"{busy / 1e3:.1f} ms ({100 * busy / 1e3 / (1e3 * wall):.0f}%), {len(gpu)} device activities; per "
              f"token: wall {1e6 * wall / tokens:.1f} us, busy {busy / tokens:.1f} us", flush=True)
    base = runs["without"]["kernels"]
    rows = sorted(((total - base.get(n, [0, 0.0])[1], count, base.get(n, [0, 0.0])[0], n)
                   for n, (count, total) in runs["with"]["kernels"].items()), reverse=True)
    print(f"[busy {label}] kernels, with - without (us per run; count with / without):")
    for d, count, p_count, n in rows[:top]:
        print(f"    {d:10.1f} {count:6d} {p_count:6d}  {n}")
    for r in runs.values():  # (the JSON keeps each run's 40 largest)
        top40 = sorted(r["kernels"].items(), key=lambda kv: -kv[1][1])[:40]
        r["kernels"] = {n: dict(count=c, us=t) for n, (c, t) in top40}
    return runs


def step_kind(plan, k: int) -> str:
    """The kind of step a plan schedules: empty, plain decode (one token per request), verify (at most k + 1 per
    request) or prefill."""
    n, reqs = plan.total_num_scheduled_tokens, len(plan.num_scheduled_tokens)
    return "empty" if n == 0 else "plain" if n == reqs else "verify" if n <= reqs * (k + 1) else "prefill"


def run_profile_diff(plain, spec, prompts, params, one_by_one: bool, label: str, top: int = 30) -> None:
    """cProfile of one run of each engine (every function, torch's and Triton's included): the functions whose
    own time grows most from the plain engine's run to the speculating engine's (ms per run), and each run's top."""
    import cProfile
    import pstats

    runs = {}
    for name, llm in (("without", plain), ("with", spec)):
        prof = cProfile.Profile()
        prof.enable()
        _, tokens = timed_generate(llm, prompts, params, one_by_one)
        prof.disable()
        funcs = {}
        for (file, line, fn), (_, ncalls, tottime, cumtime, _) in pstats.Stats(prof).stats.items():
            short = "/".join(file.split("/")[-2:])
            funcs[f"{short}:{line}({fn})"] = (ncalls, 1e3 * tottime, 1e3 * cumtime)
        runs[name] = funcs
        print(f"[profile {label}, {name}] {tokens} tokens; top own time (ms per run, calls):")
        for key, (calls, tot, cum) in sorted(funcs.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"    {tot:8.2f} {cum:8.2f} {calls:6d}  {key}")
    rows = []
    for key, (calls, tot, cum) in runs["with"].items():
        p_calls, p_tot, p_cum = runs["without"].get(key, (0, 0.0, 0.0))
        rows.append((tot - p_tot, cum - p_cum, calls, p_calls, key))
    print(f"[profile {label}] with - without, by own time (ms per run; calls with / without):")
    for d_tot, d_cum, calls, p_calls, key in sorted(rows, reverse=True)[:top]:
        print(f"    {d_tot:8.2f} {d_cum:8.2f} {calls:6d} {p_calls:6d}  {key}")


def step_times(llm, prompts, params, one_by_one: bool, label: str, k: int) -> dict:
    """Where one timed run's wall time goes: engine steps by the kind of step they schedule (prefill, plain decode,
    verify), their count and mean wall time, and the time outside engine steps (adding requests, output
    processing). With async scheduling a step's wall includes waiting for the step before it: read the means as
    the rate steps of each kind run at."""
    from pagedllm.core import scheduler as sched_mod

    schedule = sched_mod.Scheduler.schedule
    kinds: list[str] = []

    def recording_schedule(self, *a, **kw):
        plan = schedule(self, *a, **kw)
        kinds.append(step_kind(plan, k))
        return plan

    engine = llm.engine
    engine_step = engine.step
    totals: dict[str, list[float]] = {}

    def timed_step():
        before = len(kinds)
        t0 = time.perf_counter()
        try:
            return engine_step()
        finally:
            kind = "+".join(sorted(set(kinds[before:]))) or "none"
            totals.setdefault(kind, [0, 0.0])
            totals[kind][0] += 1
            totals[kind][1] += time.perf_counter() - t0

    sched_mod.Scheduler.schedule = recording_schedule
    engine.step = timed_step
    try:
        wall, tokens = timed_generate(llm, prompts, params, one_by_one)
    finally:
        sched_mod.Scheduler.schedule = schedule
        del engine.step
    in_steps = sum(t for _, t in totals.values())
    print(f"[steps {label}] {tokens} tokens in {1e3 * wall:.1f} ms: outside steps {1e3 * (wall - in_steps):.1f} ms; "
          + "; ".join(f"{kind} {n} x {1e3 * t / n:.3f} ms" for kind, (n, t) in sorted(totals.items())))
    return dict(wall_ms=1e3 * wall, tokens=tokens, outside_ms=1e3 * (wall - in_steps),
                steps={kind: dict(n=n, mean_ms=1e3 * t / n) for kind, (n, t) in totals.items()})


def run_ngram(args) -> dict:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    if args.batch_size == 1:  # the four repeat / edit tasks, one request at a time
        return compare_throughput(args, lambda llm: chat_prompts(llm, len(TASK_SETS[args.tasks]), args.tasks), params,
                                  f"ngram batch 1, {args.tasks} tasks",
                                  one_by_one=True)
    return compare_throughput(args, lambda llm: chat_prompts(llm, args.batch_size, args.tasks), params,
                              f"ngram batch {args.batch_size}")


def draft_config(args) -> dict:
    c = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k}
    if args.load_format == "dummy":
        c["draft_load_format"] = "dummy"
    if args.disable_by_batch_size is not None:
        c["disable_by_batch_size"] = None if args.disable_by_batch_size <= 0 else args.disable_by_batch_size
    return c


def run_draft(args) -> dict:
    """Draft-model speculation at batch 1, the engines alternating request by request: tokens/s with vs without,
    the acceptance, both engines' steps by kind, and from those step costs the speed-up a given acceptance rate
    would give ((1 - a^(k+1)) / (1 - a) tokens per verify step, against the plain step): with random weights
    (--load-format dummy: the target's shape beside a draft's) acceptance means nothing and the projection is the
    row; with real weights (SmolLM2 drafting for itself) the measured ratio is."""
    from pagedllm import SamplingParams

    dummy = args.load_format == "dummy"
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=dummy)
    plain, spec = make_llm(args, None), make_llm(args, draft_config(args))

    def prompts_of(llm):
        if dummy:
            return random_prompts(llm, 4, args.input_len)
        return chat_prompts(llm, len(TASK_SETS[args.tasks]), args.tasks)

    label = f"draft batch 1, {'random prompts' if dummy else args.tasks + ' tasks'}"
    out = compare_throughput(args, prompts_of, params, label, engines=(plain, spec), one_by_one=True)
    prompts = prompts_of(plain)
    costs = {name: step_times(llm, prompts, params, True, f"{label}, {name}", args.k)
             for name, llm in (("without", plain), ("with", spec))}
    plain_ms = costs["without"]["steps"].get("plain", {}).get("mean_ms")
    verify_ms = costs["with"]["steps"].get("verify", {}).get("mean_ms")
    out["step_times"] = costs
    if plain_ms and verify_ms:
        k = args.k
        proj = {a: (1 - a ** (k + 1)) / (1 - a) * plain_ms / verify_ms for a in (0.5, 0.6, 0.7, 0.8, 0.9)}
        print(f"[{label}] plain step {plain_ms:.3f} ms, verify step with the draft's proposal {verify_ms:.3f} ms "
              f"({verify_ms / plain_ms:.2f}x); projected speed-up at acceptance " +
              ", ".join(f"{int(100 * a)}% {r:.2f}x" for a, r in proj.items()))
        out["projected"] = proj
    return out


def run_steps(args) -> dict:
    """Engine steps by kind (plain decode, verify, prefill) for the four tasks one at a time, greedy: without
    n-gram, overlapped (the default with async scheduling), waiting (PAGEDLLM_SPEC_OVERLAP=0), and overlapped with
    k placeholder drafts for every caught-up request ("always": an experiment of this script, not an engine
    option). Step counts are exact on any device (in fp32 the tokens are the same in every run), so
    steps x each kind's cost (from `verify`) predicts the ratio `ngram` measures."""
    from pagedllm import SamplingParams
    from pagedllm.core import scheduler as sched_mod
    from pagedllm.spec_decode import scheduling

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    counts: dict = {}
    policy = {"always": False}
    schedule = sched_mod.Scheduler.schedule

    def counting_schedule(self, *a, **kw):
        if policy["always"] and self.spec.overlap:  # every caught-up request verifies k device drafts
            for r in self.running:
                if not r.spec_token_ids and r.num_output_tokens > 0:
                    r.spec_token_ids = [scheduling.PLACEHOLDER]
        plan = schedule(self, *a, **kw)
        kind = step_kind(plan, args.k)
        counts[kind] = counts.get(kind, 0) + 1
        return plan

    sched_mod.Scheduler.schedule = counting_schedule
    rows = []
    for label, spec, overlap, always in (("without", None, "1", False), ("overlapped", ngram_config(args), "1", False),
                                         ("waiting", ngram_config(args), "0", False),
                                         ("always", ngram_config(args), "1", True)):
        os.environ["PAGEDLLM_SPEC_OVERLAP"] = overlap
        policy["always"] = always
        llm = make_llm(args, spec)
        prompts = chat_prompts(llm, len(TASK_SETS[args.tasks]), args.tasks)
        counts.clear()
        tokens = sum(len(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts)
        row = dict(label=label, tokens=tokens, **{k: counts.get(k, 0) for k in ("plain", "verify", "prefill")})
        rows.append(row)
        print(f"[steps] {label:10s} {tokens} tokens: {row['plain']} plain + {row['verify']} verify + "
              f"{row['prefill']} prefill steps", flush=True)
        del llm
    sched_mod.Scheduler.schedule = schedule
    return dict(rows=rows)


def run_batch(args) -> dict:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    return compare_throughput(args, lambda llm: random_prompts(llm, args.batch_size, args.input_len), params,
                              f"batch {args.batch_size}")


def sweep_random_prompts(args) -> bool:
    """Whether the sweep runs random token prompts (asked for, or a dummy model's default) rather than chat tasks."""
    return args.prompts == "random" or (args.prompts is None and args.load_format == "dummy")


def run_sweep(args) -> dict:
    """With vs without n-gram speculation (forced on: no disable_by_batch_size) at each batch size, both engines
    built once: the largest batch where it still pays, and where it costs > 5%, set disable_by_batch_size."""
    from pagedllm import SamplingParams

    sizes = args.batch_sizes or [1, 2, 4, 8, 16, 32, 64]
    random_in = sweep_random_prompts(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=random_in)
    args.batch_size = max(sizes)
    args.disable_by_batch_size = 0  # force speculation on to measure it
    engines = (make_llm(args, None), make_llm(args, ngram_config(args)))
    results = []
    for b in sizes:
        prompts_of = (lambda llm, b=b: random_prompts(llm, b, args.input_len)) if random_in else (
            lambda llm, b=b: chat_prompts(llm, b, args.tasks))
        r = compare_throughput(args, prompts_of, params, f"sweep batch {b}", engines=engines)
        r["batch_size"] = b
        results.append(r)
    print("batch  with/without  acceptance")
    for r in results:
        acc = statistics.median(row["acceptance"] for row in r["rows"])
        print(f"{r['batch_size']:5d}  {r['median_ratio']:12.3f}  {100 * acc:9.1f}%")
    paying = [r["batch_size"] for r in results if r["median_ratio"] >= 1.0]
    costly = [r["batch_size"] for r in results if r["median_ratio"] < 0.95]
    print("largest batch where n-gram speculation pays:", max(paying, default=None),
          "| smallest batch where it costs > 5%:", min(costly, default=None))
    return dict(sweep=results)


def run_verify(args) -> dict:
    """Per-step time of a k-token verify step vs a plain decode step at batch 1, the same engine, interleaved
    blocks of steps. Drafts are injected (random weights: n-gram would find none); all are rejected, which does
    not change the step's cost."""
    from pagedllm import SamplingParams
    from pagedllm.core.engine_core import EngineCoreRequest

    spec = ngram_config(args)
    spec["disable_by_batch_size"] = None
    llm = make_llm(args, spec)
    engine, sched = llm.engine, llm.engine.scheduler
    k = args.k
    prompt = random_prompts(llm, 1, args.input_len)[0]["prompt_token_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_model_len - args.input_len - 8, ignore_eos=True)
    ids = itertools.count()

    def fresh_request() -> None:
        """The measured request, (re)started at the prompt: a block of steps must not run past max_model_len."""
        for r in list(sched.running):
            engine.abort_requests([r.request_id])
        engine.add_request(EngineCoreRequest(f"r{next(ids)}", prompt, params))
        for _ in range(3):
            engine.step()  # prefill + first decodes

    def room(n_steps: int) -> None:
        # every draft is rejected: a verify block and a plain block of n steps add 2 x n tokens
        if args.input_len + 2 * n_steps + k + 16 > args.max_model_len:
            raise SystemExit(f"{n_steps} x 2 steps past a {args.input_len}-token prompt do not fit --max-model-len "
                             f"{args.max_model_len}")
        if not sched.running or sched.running[0].num_tokens + 2 * n_steps + k + 8 > args.max_model_len:
            fresh_request()

    fresh_request()
    device = llm.engine.worker.runner.spec.device_ngram
    if device is not None:
        # Overlapped verify steps verify the device's drafts whatever the host injects: make that lookup find nothing
        # (no n fits the context), so every step verifies k padding drafts that the model rejects, as injected ones.
        device.min_n = device.max_n = args.max_model_len + 1

    def block(verify: bool, n: int) -> float:
        sched.spec.k = k if verify else 0
        sync()
        start = time.perf_counter()
        for _ in range(n):
            for r in sched.running:
                r.spec_token_ids = [11] * k if verify else []
            engine.step()
        sync()
        return (time.perf_counter() - start) / n

    block(True, 10)
    block(False, 10)
    if args.host_profile:
        room(3 * args.host_profile)  # host_profile runs each kind's n steps three times
        host = {name: host_profile(lambda n, v=v: block(v, n), name, args.host_profile)
                for name, v in (("plain", False), ("verify", True))}
        print_host_diff(host, k)
    if args.profile and torch_cuda():
        # Device time only (kernels, inside graphs too): what the verify step costs the GPU, without the host
        # work that a speculating step cannot overlap (it waits for the previous step's drafts).
        k_plain, k_verify = {}, {}
        room(20)
        d_plain = device_ms(lambda: block(False, 20), 20, k_plain)
        d_verify = device_ms(lambda: block(True, 20), 20, k_verify)
        print(f"[verify k={k}] device time per step: plain decode {d_plain:.3f} ms   verify {d_verify:.3f} ms   "
              f"ratio {d_verify / d_plain:.3f}")
        print_kernel_diff(k_plain, k_verify)
    ratios, rows = [], []
    for it in range(args.iters):
        room(args.steps)
        context = sched.running[0].num_tokens
        t_plain = block(False, args.steps)
        t_verify = block(True, args.steps)
        ratios.append(t_verify / t_plain)
        rows.append(dict(iter=it, context=context, plain_ms=1e3 * t_plain, verify_ms=1e3 * t_verify,
                         ratio=t_verify / t_plain))
        print(f"[verify k={k}] iter {it} (context {context}..{context + 2 * args.steps}): plain decode step "
              f"{1e3 * t_plain:.3f} ms   verify step ({k + 1} tokens) {1e3 * t_verify:.3f} ms   "
              f"ratio {t_verify / t_plain:.3f}")
    engine.abort_requests([r.request_id for r in list(sched.running)])
    counted = (f"{sched.spec_stats.num_drafts} verify steps ran, {sched.spec_stats.num_draft_tokens} draft tokens"
               if device is None else "overlapped: every verify step checked k padding drafts, which the drafting "
               "statistics do not count")
    print(f"[verify k={k}] median verify/plain step time: {statistics.median(ratios):.3f} ({counted})")
    out = dict(rows=rows, median_ratio=statistics.median(ratios))
    if args.host_profile:
        out["host"] = {name: {key: v for key, v in h.items() if key != "funcs"} for name, h in host.items()}
    return out


class _OpCounter:
    """Counts the eager torch ops a block of steps dispatches (CUDA-graph replays dispatch none), and among them
    the host syncs: on CUDA each op that reads a device value on the host (item / tolist / .cpu() / nonzero,
    i.e. aten._local_scalar_dense and copies to the host) and each event / stream / device synchronize. On the
    CPU (no device) the same ops are counted as the syncs they would be on a GPU."""

    SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique2"}

    def __init__(self):
        import collections

        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.ops = collections.Counter()
        self.syncs = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket)
                counter.ops[name] += 1
                if name in _OpCounter.SYNC_OPS or _to_host(name, args, kwargs or {}):
                    counter.syncs[name] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        import torch

        self._patched = []
        if torch.cuda.is_available():  # explicit waits do not dispatch: count them by wrapping
            for owner, attr in ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
                                (torch.cuda, "synchronize")):
                orig = getattr(owner, attr)
                self._patched.append((owner, attr, orig))
                setattr(owner, attr, self._counting(orig, f"{getattr(owner, '__name__', 'cuda')}.{attr}"))
        self.mode.__enter__()
        return self

    def _counting(self, orig, label):
        def wrapped(*a, **kw):
            self.syncs[label] += 1
            return orig(*a, **kw)
        return wrapped

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for owner, attr, orig in self._patched:
            setattr(owner, attr, orig)


def _to_host(name: str, args, kwargs) -> bool:
    """A copy from a device tensor into host memory (copy_ into a CPU tensor, .to("cpu") / .cpu())."""
    import torch

    if name == "aten.copy_" and len(args) >= 2:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    if name == "aten._to_copy" and args and isinstance(args[0], torch.Tensor):
        dev = kwargs.get("device")
        return args[0].device.type != "cpu" and dev is not None and torch.device(dev).type == "cpu"
    return False


def host_profile(run_steps, label: str, n: int) -> dict:
    """Host cost of n steps: eager ops and host syncs per step (dispatch counter), wall ms per step, and the
    pagedllm functions' own time per step (cProfile; inflated by the profiler, read as shares)."""
    import cProfile
    import pstats

    with _OpCounter() as c:
        run_steps(n)
    sync()
    start = time.perf_counter()
    run_steps(n)
    sync()
    wall = (time.perf_counter() - start) / n * 1e3
    prof = cProfile.Profile()
    prof.enable()
    run_steps(n)
    prof.disable()
    funcs = {}
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in pstats.Stats(prof).stats.items():
        if "pagedllm" in file or file.startswith("~"):
            key = f"{file.split('src/pagedllm/')[-1]}:{line}({fn})" if "pagedllm" in file else fn
            funcs[key] = (ncalls / n, 1e3 * tottime / n, 1e3 * cumtime / n)
    ops, syncs = sum(c.ops.values()) / n, sum(c.syncs.values()) / n
    print(f"[host {label}] {ops:.1f} eager ops/step, {syncs:.1f} host syncs/step "
          f"({', '.join(f'{k} {v / n:g}' for k, v in c.syncs.most_common())}), wall {wall:.3f} ms/step")
    print(f"[host {label}] ops/step: " + ", ".join(f"{k} {v / n:g}" for k, v in c.ops.most_common()))
    return dict(ops=ops, syncs=syncs, wall_ms=wall, op_counts={k: v / n for k, v in c.ops.items()},
                sync_counts={k: v / n for k, v in c.syncs.items()}, funcs=funcs)


def print_host_diff(host: dict, k: int, top: int = 25) -> None:
    """The functions whose cumulative host time per step grows most from a plain step to a verify step."""
    plain, verify = host["plain"]["funcs"], host["verify"]["funcs"]
    rows = []
    for key, (calls, tot, cum) in verify.items():
        p = plain.get(key, (0.0, 0.0, 0.0))
        rows.append((cum - p[2], tot - p[1], calls, p[0], key))
    rows.sort(reverse=True)
    print(f"[host k={k}] verify - plain, per step (cProfile ms; cum = with callees):")
    print(f"{'d cum ms':>9} {'d own ms':>9} {'calls':>6} {'(plain)':>7}  function")
    for d_cum, d_tot, calls, p_calls, key in rows[:top]:
        print(f"{d_cum:9.3f} {d_tot:9.3f} {calls:6.1f} {p_calls:7.1f}  {key}")
    # the same by own time: where the extra host time is spent rather than which callers it runs under
    print(f"[host k={k}] verify - plain by own time:")
    for d_cum, d_tot, calls, p_calls, key in sorted(rows, key=lambda r: r[1], reverse=True)[:top]:
        print(f"{d_cum:9.3f} {d_tot:9.3f} {calls:6.1f} {p_calls:7.1f}  {key}")


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def device_ms(fn, num_steps: int, per_kernel: Optional[dict] = None) -> float:
    """Kernel time per step (ms) of fn() running num_steps steps, from the torch profiler (CUDA activity);
    per_kernel: filled with us per step of each kernel name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    if per_kernel is not None:
        for e in events:
            per_kernel[e.key] = per_kernel.get(e.key, 0.0) + e.self_device_time_total / num_steps
    return sum(e.self_device_time_total for e in events) / num_steps / 1e3


def print_kernel_diff(plain: dict, verify: dict, top: int = 15) -> None:
    """The kernels whose time per step differs most between a verify step and a plain one."""
    names = sorted(set(plain) | set(verify), key=lambda n: -abs(verify.get(n, 0.0) - plain.get(n, 0.0)))
    print(f"{'us per step: plain':>28s} {'verify':>9s} {'diff':>8s}  kernel")
    for name in names[:top]:
        a, b = plain.get(name, 0.0), verify.get(name, 0.0)
        print(f"{a:28.1f} {b:9.1f} {b - a:+8.1f}  {name[:110]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["ngram", "verify", "batch", "sweep", "steps", "draft"])
    p.add_argument("--model", default=None)
    p.add_argument("--draft-model", default=None, help="draft: the draft model (its own config or checkpoint)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-min", type=int, default=1, help="ngram: prompt_lookup_min")
    p.add_argument("--lookup-max", type=int, default=4, help="ngram: prompt_lookup_max")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--steps", type=int, default=100, help="verify: steps per timed block")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="per engine (two engines at once)")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="speculative_config disable_by_batch_size (0: never turn speculation off)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="sweep: batch sizes (default 1..64)")
    p.add_argument("--tasks", choices=sorted(TASK_SETS), default="edit",
                   help="ngram / steps / sweep chat prompts: the repeat / edit tasks or the code-editing ones")
    p.add_argument("--prompts", choices=["chat", "random"], default=None,
                   help="sweep: the repeat / edit chat tasks (needs a tokenizer) or random token prompts "
                        "(default: random with --load-format dummy)")
    p.add_argument("--no-async", action="store_true",
                   help="async_scheduling=False for both engines (verify: both steps pay their host work)")
    p.add_argument("--async", dest="async_scheduling", action="store_true",
                   help="async_scheduling=True for both engines (the CUDA default; on the CPU it runs the overlapped "
                        "verify steps' host path)")
    p.add_argument("--profile", action="store_true", help="verify: also print device (kernel) time per step")
    p.add_argument("--step-times", action="store_true",
                   help="ngram / batch / sweep: after the timed runs, one more run of each engine with its engine "
                        "steps timed by kind (prefill, plain, verify) and the time outside steps")
    p.add_argument("--run-profile", action="store_true",
                   help="ngram / batch / sweep: after the timed runs, cProfile one run of each engine and print "
                        "what the speculating engine's run adds")
    p.add_argument("--device-busy", action="store_true",
                   help="ngram / batch / sweep: after the timed runs, one run of each engine under the torch profiler "
                        "(device activity): wall vs GPU busy time, and the kernels the speculating engine adds")
    p.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                   help="verify: count eager ops and host syncs per step over STEPS plain and STEPS verify steps, "
                        "and list the host functions whose time grows most in a verify step (cProfile)")
    p.add_argument("--mma-variant", default=None,
                   help="a launch rule of the tensor-core GEMV from benchmarks/gemv.py's MMA_VARIANTS (A/B)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.mma_variant:
        from gemv import MMA_VARIANTS

        from pagedllm.kernels import gemv_mma

        if args.mma_variant not in MMA_VARIANTS:
            p.error(f"--mma-variant {args.mma_variant!r}: not one of {sorted(MMA_VARIANTS)}")
        plain, gated = MMA_VARIANTS[args.mma_variant]
        for mt in gemv_mma.ROW_TILES:  # the variant's options over the defaults at every row count, as in the chain
            for is_gated, options in ((False, plain), (True, gated)):
                gemv_mma.ROW_TILE_CONFIG[(is_gated, mt)] = {**gemv_mma.base_config(is_gated, mt), **options}
    chat_modes = {"ngram", "steps"} | (set() if sweep_random_prompts(args) else {"sweep"})
    if args.load_format != "dummy":
        chat_modes.add("draft")
    for flag, used, modes in (("--step-times", args.step_times, {"ngram", "batch", "sweep"}),
                              ("--run-profile", args.run_profile, {"ngram", "batch", "sweep"}),
                              ("--device-busy", args.device_busy, {"ngram", "batch", "sweep"}),
                              ("--tasks", args.tasks != "edit", chat_modes)):
        if used and args.mode not in modes:
            p.error(f"{flag} applies to the {' / '.join(sorted(modes))} modes, not {args.mode}")
    if args.device_busy:
        import torch

        if not torch.cuda.is_available():
            p.error("--device-busy measures the GPU's busy time: it needs a CUDA device")
    if (args.mode == "draft") != bool(args.draft_model):
        p.error("--draft-model is the draft mode's (and that mode needs it)")
    if args.mode == "draft" and args.batch_size not in (None, 1):
        p.error("draft measures batch 1 (requests one at a time)")
    defaults = {"ngram": (1, 256), "verify": (1, 0), "batch": (64, 256), "sweep": (1, 192), "steps": (1, 256),
                "draft": (1, 128)}
    b, out_len = defaults[args.mode]
    args.batch_size = args.batch_size or b
    args.output_len = args.output_len or out_len
    result = {"ngram": run_ngram, "verify": run_verify, "batch": run_batch, "sweep": run_sweep,
              "steps": run_steps, "draft": run_draft}[args.mode](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), result=result), f, indent=1)


if __name__ == "__main__":
    main()
