"""What the multi-process executor costs at one rank: the in-process Worker (`uni`, the default for one device)
vs one worker process driven over the executor's message queue (`mp`), alternating fresh processes.

    python benchmarks/executor_overhead.py --mode latency --model benchmarks/configs/llama3-8b --load-format dummy
    python benchmarks/executor_overhead.py --mode throughput --model benchmarks/configs/qwen3-0.6b \
        --load-format dummy

latency: batch-1 decode, ms per step (input 128, output 256 tokens; steps after the first token).
throughput: 256 requests, input/output U(100..1024), output tokens per second.
Prints each process's number and mp / uni (latency: lower is better; throughput: higher is better).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time


def _child(args) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.core.engine_core import EngineCoreRequest

    kwargs = dict(model=args.model, load_format=args.load_format, skip_tokenizer_init=True, seed=0,
                  distributed_executor_backend=args.backend, device=args.device)
    rng = random.Random(0)
    if args.mode == "latency":
        llm = LLM(max_num_seqs=8, max_model_len=512, **kwargs)
        engine = llm.engine
        prompt = [rng.randrange(10, min(engine.vocab_size, 32000)) for _ in range(128)]
        params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
        per_step = []
        for it in range(args.iters + 1):  # the first run warms up
            engine.add_request(EngineCoreRequest(f"r{it}", prompt, params))
            engine.reset_prefix_cache()
            stamps = []
            while engine.has_unfinished_requests():
                engine.step()
                stamps.append(time.perf_counter())
            if it:
                decode = stamps[2:]  # after the prefill step and the first decode
                per_step.append((decode[-1] - decode[0]) / (len(decode) - 1) * 1e3)
        return {"ms_per_step": statistics.median(per_step)}
    llm = LLM(max_num_seqs=256, max_model_len=2048, **kwargs)
    vocab = min(llm.engine.vocab_size, 32000)
    reqs = [([rng.randrange(10, vocab) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
            for _ in range(256)]
    llm.generate([{"prompt_token_ids": reqs[0][0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs],
                        use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return {"tok_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["latency", "throughput"], required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--rounds", type=int, default=2, help="uni, mp pairs of fresh processes")
    p.add_argument("--iters", type=int, default=3, help="latency: timed runs per process")
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    if args.backend:
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return
    key = "ms_per_step" if args.mode == "latency" else "tok_per_s"
    results: dict[str, list[float]] = {"uni": [], "mp": []}
    for _ in range(args.rounds):
        for backend in ("uni", "mp"):
            cmd = [sys.executable, __file__, "--mode", args.mode, "--load-format", args.load_format, "--device",
                   args.device, "--iters", str(args.iters), "--backend", backend]
            if args.model:
                cmd += ["--model", args.model]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{backend} run failed:\n{out.stderr[-3000:]}")
            value = json.loads(line[7:])[key]
            results[backend].append(value)
            print(f"{backend:>3}: {key} = {value:.3f}", flush=True)
    uni, mp = statistics.median(results["uni"]), statistics.median(results["mp"])
    print(f"median uni {uni:.3f}, mp {mp:.3f} {key}; mp / uni = {mp / uni:.4f}")


if __name__ == "__main__":
    main()
