"""Greedy decode with the LM head + argmax replayed as graphs ("greedy tails", worker/greedy_tail.py) vs eager
(PAGEDLLM_GRAPH_GREEDY=0): both engines in one process, requests alternating between them (the host's noise falls on
both alike), batch 1 and a few rows. --temperature T (and --top-p): sampled decode, the sampled tails
(PAGEDLLM_GRAPH_SAMPLE) against the eager LM head and sampler.

    python benchmarks/greedy_tail.py --model benchmarks/configs/smollm2-135m --load-format dummy --dtype bfloat16
    python benchmarks/greedy_tail.py --model SmolLM2-135M-Instruct.Q4_1.gguf --load-format auto --dtype bfloat16

Prints ms per decode step (wall time / output tokens of a batch of `--batch` requests of `--output-len` tokens,
ignore_eos) per engine and round, then the medians and their ratio; --json FILE writes them too."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def switch(args) -> str:
    return "PAGEDLLM_GRAPH_SAMPLE" if args.temperature > 0 else "PAGEDLLM_GRAPH_GREEDY"


def make_llm(args, tails: bool):
    from pagedllm import LLM

    os.environ[switch(args)] = "1" if tails else "0"  # read when the engine makes its graphs
    try:
        return LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=2048,
                   skip_tokenizer_init=args.load_format == "dummy", gpu_memory_utilization=0.2,
                   max_num_seqs=max(args.batch), enable_prefix_caching=False)
    finally:
        os.environ.pop(switch(args), None)


def ms_per_step(llm, batch: int, output_len: int, temperature: float = 0.0, top_p: float = 1.0) -> float:
    import torch

    from pagedllm import SamplingParams

    prompts = [{"prompt_token_ids": [100 + 7 * i + j for j in range(16)]} for i in range(batch)]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=output_len, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return 1e3 * (time.perf_counter() - start) / output_len


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="benchmarks/configs/smollm2-135m")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the greedy tails)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--json")
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("greedy_tail.py compares CUDA graph paths: no CUDA device here")
    engines = {"tails": make_llm(args, True), "eager": make_llm(args, False)}
    graphs = engines["tails"].engine.worker.runner.cuda_graphs
    tails = graphs.sample_tails if args.temperature > 0 else graphs.tails
    if args.temperature == 0 and not tails.graphs:
        raise SystemExit("the engine with PAGEDLLM_GRAPH_GREEDY=1 captured no greedy tails (see its log)")
    sampling = (args.temperature, args.top_p)
    results = {}
    for batch in args.batch:
        times = {name: [] for name in engines}
        for name, llm in engines.items():  # warm-up
            ms_per_step(llm, batch, 16, *sampling)
        for r in range(args.rounds):
            order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
            for name, llm in order:
                times[name].append(ms_per_step(llm, batch, args.output_len, *sampling))
            print(f"[tails batch {batch}] round {r}: " + "   ".join(f"{n} {times[n][-1]:.3f} ms/step"
                                                                  for n in engines), flush=True)
        med = {name: statistics.median(t) for name, t in times.items()}
        ratio = med["eager"] / med["tails"]
        print(f"[tails batch {batch}] median ms/step: tails {med['tails']:.3f}, eager {med['eager']:.3f}: "
              f"{ratio:.3f}x faster with the tails ({1e3 / med['tails'] * batch:.0f} vs "
              f"{1e3 / med['eager'] * batch:.0f} tok/s)", flush=True)
        results[batch] = {"times": times, "median": med, "ratio": ratio}
    if tails.num_replays == 0:
        raise SystemExit("the engine with the tails never replayed one (see its log)")
    print(f"[tails] tail replays: {tails.num_replays}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
