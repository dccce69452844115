"""Where an offline run's time goes, step by step: wall time per engine step grouped by how many requests
were running, split into host phases and time waiting on the device.

    python benchmarks/step_timeline.py --model benchmarks/configs/qwen3-0.6b --load-format dummy \\
        --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --max-model-len 2048

Same workload as offline_throughput.py. With async scheduling (the CUDA default) a step whose host phases add
up to about its wall time is host-bound: the device finished the previous step and waited for the host.
A step with a large "wait" is device-bound.

Columns: schedule (Scheduler.schedule), launch (the runner's launch: inputs, forward and sampling enqueued; on
CPU it also runs them), of which prepare (InputBatch.update + prepare) and sampmeta (the step's sampling
metadata); apply (Scheduler.update_from_output, which in async mode includes waiting for the step's tokens),
of which finish (the runner's host side of a finished step); emit (OutputProcessor.process_outputs, with
--emit: delta mode as the API process runs it, or --emit final_only as the offline LLM does).

--host-only isolates the host: a tiny model of the same architecture (one layer, hidden 64, vocab
--host-vocab) whose forward is skipped (it returns a persistent zero tensor), so a step's wall time on the CPU
is the engine's own host work per step: scheduler, input preparation, sampling metadata, the sampler's few
small ops, output handling. Measure it at a fixed number of running requests with equal lengths, e.g.

    python benchmarks/step_timeline.py --model benchmarks/configs/qwen3-0.6b --host-only --num-prompts 256 \\
        --max-num-seqs 256 --input-len 64 64 --output-len 96 96 --temperature 0.6 --emit

On CUDA it also times the device: "device" is the span from the start of a step's first enqueued work to the end
of its last (CUDA events around the launch), "idle" the time the device sat waiting for the host before the step's
work began. Steps with large idle are host-bound.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline_throughput import make_requests  # noqa: E402

CLOCK = [time.perf_counter]  # --clock process: this process's CPU time (a shared machine's other jobs drop out)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32}


def tiny_config_dir(model: str, vocab: int) -> str:
    """The model's config.json with the tiny shape (same architecture), in a temporary directory."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(TINY, vocab_size=vocab, bos_token_id=0, eos_token_id=vocab - 1, torch_dtype="float32")
    out = tempfile.mkdtemp(prefix="pagedllm-step-timeline-")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def skip_forward(model: torch.nn.Module, max_tokens: int) -> None:
    """Replace the forward with a persistent zero tensor of the step's shape: only host work remains."""
    hidden = torch.zeros(max_tokens, model.config.hidden_size if hasattr(model, "config") else TINY["hidden_size"])

    def forward(input_ids, positions, *a, **k):
        return hidden[:input_ids.shape[0]]
    model.forward = forward


def skip_lm_head(model: torch.nn.Module, max_rows: int, vocab: int) -> None:
    """Greedy steps: the LM head's argmax becomes a slice of a persistent pool of random ids, a new slice each step
    (device work on a GPU; on this CPU it would cost about as much as the host work measured). Ids from 256 on:
    in --detokenize's synthetic tokenizer those are whole ASCII tokens, which decode as text does (ids below are
    single bytes, whose incomplete characters would grow the detokenizer's window)."""
    low = 256 if vocab > 512 else 0
    pool = torch.randint(low, vocab - 1, (max_rows + 4093,), generator=torch.Generator().manual_seed(0))
    offset = [0]

    def greedy_token_ids(hidden_states, token_bitmask=None):
        start = offset[0] = (offset[0] + 1) % 4093
        return pool[start:start + hidden_states.shape[0]]
    model.greedy_token_ids = greedy_token_ids


class Phases:
    def __init__(self) -> None:
        self.t = defaultdict(float)

    def wrap(self, obj, name: str, key: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return
        t = self.t

        def inner(*a, **k):
            t0 = CLOCK[0]()
            try:
                return fn(*a, **k)
            finally:
                t[key] += CLOCK[0]() - t0
        setattr(obj, name, inner)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 160])
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 160])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0, help="0 greedy; the nano-vllm protocol uses 0.6")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--emit", nargs="?", const="delta", default=None, choices=["delta", "final_only"],
                   help="also run the OutputProcessor on each step: delta (the API process) or final_only (LLM)")
    p.add_argument("--host-only", action="store_true", help="tiny same-architecture model, forward skipped")
    p.add_argument("--host-vocab", type=int, default=4096)
    p.add_argument("--skip-lm-head", action="store_true",
                   help="with --host-only, greedy: the LM head's argmax returns fixed random ids (no vocab product)")
    p.add_argument("--detokenize", action="store_true",
                   help="--emit with a synthetic byte-level tokenizer of the vocab (the offline LLM detokenizes)")
    p.add_argument("--json", default=None, help="write the per-bucket table as JSON here")
    p.add_argument("--clock", choices=["wall", "process"], default="wall",
                   help="process: CPU time of this process (with --host-only on a busy CPU machine)")
    return p.parse_args(argv)


def build_engine(args):
    from pagedllm import LLM

    model = args.model
    kwargs = dict(load_format=args.load_format, skip_tokenizer_init=True, max_num_seqs=args.max_num_seqs)
    if args.host_only:
        if model is None:
            raise SystemExit("--host-only needs --model (a directory with a config.json)")
        model = tiny_config_dir(model, args.host_vocab)
        # One intra-op thread: the host of a GPU step is one thread, and idle OpenMP workers spinning on a shared
        # machine would make a few small ops look like milliseconds.
        torch.set_num_threads(1)
        # On the CPU even on a GPU machine: the host code is the same, and its speed is what this measures.
        kwargs.update(load_format="dummy", dtype="float32", enforce_eager=True, device="cpu",
                      kv_cache_memory_bytes=1 << 28)
    if args.max_model_len or args.host_only:
        kwargs["max_model_len"] = args.max_model_len or 2048
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.async_scheduling != "auto":
        kwargs["async_scheduling"] = args.async_scheduling == "on"
    llm = LLM(model=model, **kwargs)
    if args.host_only:
        runner = llm.engine.worker.runner
        skip_forward(runner.model, runner.max_num_batched_tokens)
        if args.skip_lm_head:
            skip_lm_head(runner.model, runner.max_num_batched_tokens, args.host_vocab)
    return llm


def main(argv=None):
    args = parse_args(argv)
    if args.clock == "process":
        CLOCK[0] = time.process_time
    from pagedllm import SamplingParams
    from pagedllm.core.engine_core import EngineCoreRequest
    from pagedllm.entrypoints.output_processor import OutputProcessor

    llm = build_engine(args)
    eng = llm.engine
    vocab = eng.worker.hf_config.vocab_size
    reqs = make_requests(args.num_prompts, args.input_len, args.output_len, min(vocab - 1, 32000), 0)

    def params(n):
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=args.temperature, top_p=args.top_p)
    warm = reqs[:2]
    llm.generate([{"prompt_token_ids": ids} for ids, _ in warm], [params(4)] * len(warm), use_tqdm=False)  # warm-up
    eng.reset_prefix_cache()  # no prefix hits from the warm-up

    ph = Phases()
    step_kind = ["mixed"]  # "decode": the step's plan computes one token per request (set by schedule)
    schedule = eng.scheduler.schedule

    def schedule_and_classify(*a, **k):
        plan = schedule(*a, **k)
        n = len(plan.num_scheduled_tokens)
        if n:
            step_kind[0] = "decode" if plan.total_num_scheduled_tokens == n else "mixed"
        return plan
    eng.scheduler.schedule = schedule_and_classify
    ph.wrap(eng.scheduler, "schedule", "schedule")
    ph.wrap(eng.scheduler, "update_from_output", "apply")
    ph.wrap(eng.worker, "launch", "launch")
    ph.wrap(eng.worker, "execute_model", "launch")  # sync steps (no async scheduling) launch and wait in one call
    runner = getattr(eng.worker, "runner", None)
    if runner is not None:
        for name in ("update", "prepare"):
            ph.wrap(runner.input_batch, name, "prepare")
        ph.wrap(runner, "_finish_step", "finish")
        ph.wrap(runner, "_sampling_metadata", "sampmeta")  # the runner's general builder, where it has one
        if hasattr(runner.input_batch, "sampling"):  # the persistent arrays' fast path
            ph.wrap(runner.input_batch.sampling, "gather", "sampmeta")
        if not hasattr(runner, "_sampling_metadata"):  # older runners build it in launch
            import pagedllm.worker.model_runner as mr

            ph.wrap(mr.SamplingMetadata, "build", "sampmeta")  # a bound classmethod, set back as a function
    tokenizer = None
    if args.emit and args.detokenize:
        from structured_output_throughput import synthetic_tokenizer

        from pagedllm.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(synthetic_tokenizer(vocab))
    processor = OutputProcessor(tokenizer) if args.emit else None
    events = []  # (bucket, start event, end event) per launch, CUDA only
    current_bucket = [1]
    if torch.cuda.is_available() and not args.host_only:
        launch = eng.worker.launch

        def launch_with_events(*a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return launch(*a, **k)
            finally:
                end.record()
                events.append(((current_bucket[0], step_kind[0]), start, end))
        eng.worker.launch = launch_with_events
    for i, (ids, n) in enumerate(reqs):
        eng.add_request(EngineCoreRequest(f"t{i}", ids, params(n)))
        if processor is not None:
            processor.add_request(f"t{i}", None, ids, params(n), output_kind=args.emit)
    buckets = defaultdict(lambda: defaultdict(float))  # running-count bucket -> totals
    walls = defaultdict(list)  # running-count bucket -> each step's wall time (spikes: what async cannot hide)
    t_start = CLOCK[0]()
    tokens = 0
    # As LLM.generate runs its loop: the start-up objects out of the collector's full passes.
    from pagedllm.core.engine_core import objects_frozen

    with objects_frozen():
        while eng.has_unfinished_requests():
            running = len(eng.scheduler.running)
            # Set before the step, so the launch inside it records this step's bucket with its events.
            b = current_bucket[0] = 1 << max(0, (max(running, 1) - 1).bit_length())  # 1, 2, 4, ..., 256
            ph.t.clear()
            t0 = CLOCK[0]()
            outs = eng.step()
            if processor is not None:
                t1 = CLOCK[0]()
                processor.process_outputs(outs)
                ph.t["emit"] += CLOCK[0]() - t1
            dt = CLOCK[0]() - t0
            tokens += sum(len(o.new_token_ids) for o in outs)
            acc = buckets[(b, step_kind[0])]
            walls[(b, step_kind[0])].append(dt)
            acc["steps"] += 1
            acc["rows"] += running
            acc["wall"] += dt
            for k, v in ph.t.items():
                acc[k] += v
    total = CLOCK[0]() - t_start
    if events:
        torch.cuda.synchronize()
        print("device ms of the first steps:", " ".join(f"{s.elapsed_time(e):.1f}" for _, s, e in events[:4]))
        for i, (b, start, end) in enumerate(events):
            buckets[b]["device"] += start.elapsed_time(end) / 1e3
            if i:
                buckets[b]["idle"] += max(0.0, events[i - 1][2].elapsed_time(start) / 1e3)
    report(buckets, tokens, total, args.json)
    print("wall ms per step, percentiles (buckets of >= 16 steps): p50 / p90 / p99 / max")
    for b in sorted(walls):
        w = sorted(walls[b])
        if len(w) >= 16:
            pick = [w[min(len(w) - 1, int(q * len(w)))] * 1e3 for q in (0.5, 0.9, 0.99)] + [w[-1] * 1e3]
            print(f"{b[0]:>6} {b[1]:>6} " + " / ".join(f"{x:.3f}" for x in pick))


COLUMNS = ("schedule", "launch", "prepare", "sampmeta", "apply", "finish", "emit", "other", "device", "idle")


def report(buckets, tokens, total, json_path=None) -> None:
    print(f"{tokens} output tokens in {total:.2f} s = {tokens / total:.0f} tok/s")
    print(f"{'running<=':>13} {'steps':>6} {'wall ms/step':>12} {'us/row':>7} "
          + " ".join(f"{c:>8}" for c in COLUMNS) + f" {'share':>6}")
    table = {}
    # Every decode step of the run in one row too: us/row is then host time per row-step of decoding (requests
    # that finish together land in smaller buckets, with their final work).
    total_decode = defaultdict(float)
    for (_, kind), a in buckets.items():
        if kind == "decode":
            for k, v in a.items():
                total_decode[k] += v
    if total_decode:
        buckets = dict(buckets)
        buckets[(0, "decode")] = total_decode
    for b in sorted(buckets):
        a = buckets[b]
        n = a["steps"]
        a["other"] = a["wall"] - a["schedule"] - a["launch"] - a["apply"] - a["emit"]
        row = {"steps": int(n), "wall_ms": a["wall"] / n * 1e3, "share": a["wall"] / total,
               "us_per_row": a["wall"] / max(a["rows"], 1) * 1e6}
        row.update({c: a[c] / n * 1e3 for c in COLUMNS})
        table[f"{b[0] or 'all'} {b[1]}"] = row
        print(f"{b[0] or 'all':>6} {b[1]:>6} {int(n):>6} {row['wall_ms']:>12.3f} {row['us_per_row']:>7.1f} " + " ".join(f"{row[c]:>8.3f}" for c in COLUMNS)
              + f" {row['share'] * 100:>5.0f}%")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"tokens": tokens, "seconds": total, "buckets": table}, f, indent=1)


if __name__ == "__main__":
    main()
