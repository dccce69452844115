"""Beam search wall time with and without partial-block copies (core/partial_blocks.py), both engines in one
process, runs interleaved.

Each beam step is one max_tokens=1 request per beam; a beam's last partly filled KV block is either copied from
the request that ended it (PAGEDLLM_PARTIAL_BLOCK_COPIES=1, the default) or recomputed (=0). The beams must be
the same either way; the script checks that and prints the time ratio.

    PYTHONUNBUFFERED=1 python benchmarks/beam_search.py --model benchmarks/configs/qwen3-0.6b --load-format dummy \
        --dtype bfloat16 --beam-width 4 --max-tokens 64 --num-prompts 8
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time


def make_llm(args, copies: bool):
    from pagedllm import LLM

    os.environ["PAGEDLLM_PARTIAL_BLOCK_COPIES"] = "1" if copies else "0"  # read when the engine is built
    try:
        return LLM(model=args.model, load_format=args.load_format, dtype=args.dtype,
                   gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                   enable_prefix_caching=True)
    finally:
        os.environ.pop("PAGEDLLM_PARTIAL_BLOCK_COPIES", None)


def prompts_for(llm, n: int, length: int, seed: int) -> list[dict]:
    """Random token prompts (fresh per seed: no prefix-cache hits across iterations); the model's vocabulary, so a
    dummy model without a tokenizer works too."""
    vocab = min(llm.engine.vocab_size, 32000)
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(length)]} for _ in range(n)]


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="per engine (two engines at once)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from pagedllm.sampling_params import BeamSearchParams

    engines = {copies: make_llm(args, copies) for copies in (True, False)}
    prompts = prompts_for(engines[True], args.num_prompts, args.input_len, 0)
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True)
    beams, times = {}, {True: [], False: []}
    for copies, llm in engines.items():  # warm-up (and the beams to compare)
        beams[copies] = [[s.tokens for s in o.sequences] for o in llm.beam_search(prompts, params)]
    same = beams[True] == beams[False]
    for it in range(args.iters):
        for copies, llm in engines.items():
            sync()
            start = time.perf_counter()
            llm.beam_search(prompts_for(llm, args.num_prompts, args.input_len, 1 + it), params)
            sync()
            times[copies].append(time.perf_counter() - start)
        print(f"[beam] iter {it}: copies {times[True][-1]:.3f} s   recompute {times[False][-1]:.3f} s   "
              f"ratio {times[True][-1] / times[False][-1]:.3f}")
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"[beam] width {args.beam_width}, {args.max_tokens} tokens, {args.num_prompts} prompts: median copies / "
          f"recompute {ratio:.3f}; same beams: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(times=times, ratio=ratio, same_beams=same), f)
    del engines
    gc.collect()


if __name__ == "__main__":
    main()
