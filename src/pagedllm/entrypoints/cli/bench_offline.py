"""`pagedllm bench throughput` and `pagedllm bench latency`: the offline engine (pagedllm.LLM), no server."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pagedllm.entrypoints.cli.arg_types import (non_negative_int, output_file, positive_int, unit_fraction,
                                                write_json)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.openai.cli_args import add_engine_args

    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    # serve's engine flags, as vLLM's bench throughput / latency take every engine argument (speculative decoding,
    # quantization, LoRA, KV-cache sizes with suffixes ...); they were a subset, the others unrecognized
    add_engine_args(p)
    p.add_argument("--output-json", type=output_file, default=None,
                   help="write the results to this JSON file (missing folders are made)")


def _make_llm(args: argparse.Namespace) -> Any:
    from pagedllm import LLM
    from pagedllm.config import EngineArgs

    names = EngineArgs.field_names()
    return LLM(**{k: v for k, v in vars(args).items() if k in names})


def add_throughput_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _add_engine_args(p)
    p.add_argument("--num-prompts", type=positive_int, default=1000)
    p.add_argument("--input-len", type=positive_int, default=1024)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--random-range-ratio", type=unit_fraction, default=0.0)
    return p


def add_latency_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _add_engine_args(p)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--input-len", type=positive_int, default=32)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--num-iters-warmup", type=non_negative_int, default=3)
    p.add_argument("--num-iters", type=positive_int, default=10)
    return p


def run_throughput(args: argparse.Namespace) -> int:
    from pagedllm import SamplingParams
    from pagedllm.entrypoints.cli.bench_serve import sample_random_requests, vocab_token_pool

    try:
        llm = _make_llm(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    requests = sample_random_requests(vocab_token_pool(llm.get_tokenizer()), args.num_prompts, args.input_len,
                                      args.output_len, args.random_range_ratio, args.seed)
    room = llm.engine.max_model_len
    longest = max(requests, key=lambda r: len(r.prompt_token_ids) + r.output_len)
    if len(longest.prompt_token_ids) < room < len(longest.prompt_token_ids) + longest.output_len:
        # (as bench latency: the engine would cut the outputs at the context's end, short of --output-len, silently)
        print(f"error: a request of {len(longest.prompt_token_ids)} prompt + {longest.output_len} output tokens "
              f"(--input-len {args.input_len}, --output-len {args.output_len}, --random-range-ratio "
              f"{args.random_range_ratio}) is more than the model's context ({room} tokens, --max-model-len)",
              file=sys.stderr)
        return 1
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.output_len, seed=args.seed + i)
              for i, r in enumerate(requests)]
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=True)
    except ValueError as e:  # a request the engine refuses (e.g. --input-len beyond --max-model-len)
        print(f"error: {e}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    num_in = sum(len(r.prompt_token_ids) for r in requests)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"elapsed_time": elapsed, "num_requests": len(requests), "total_num_tokens": num_in + num_out,
              "total_output_tokens": num_out, "requests_per_second": len(requests) / elapsed,
              "tokens_per_second": (num_in + num_out) / elapsed, "output_tokens_per_second": num_out / elapsed}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
          f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {num_in}\nTotal num output tokens:  {num_out}")
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def run_latency(args: argparse.Namespace) -> int:
    import random

    from pagedllm import SamplingParams

    try:
        llm = _make_llm(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from pagedllm.entrypoints.cli.bench_serve import vocab_token_pool

    room = llm.engine.max_model_len
    if args.input_len + args.output_len > room:  # (the outputs would be cut short: the time per step would lie)
        print(f"error: --input-len {args.input_len} + --output-len {args.output_len} is more than the model's context "
              f"({room} tokens, --max-model-len)", file=sys.stderr)
        return 1
    pool = vocab_token_pool(llm.get_tokenizer())
    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": [rng.choice(pool) for _ in range(args.input_len)]} for _ in range(args.batch_size)]
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        once()
    latencies = sorted(once() for _ in range(args.num_iters))
    avg = sum(latencies) / len(latencies)
    percentiles = latency_percentiles(latencies)
    print(f"Avg latency: {avg:.4f} seconds")
    print(f"Avg time per step (one token for the whole batch of {args.batch_size}): "
          f"{avg / args.output_len * 1000:.2f} ms")
    for p, value in percentiles.items():
        print(f"{p}% percentile latency: {value:.4f} seconds")
    if args.output_json:
        write_json(args.output_json, {"avg_latency": avg, "latencies": latencies,
                                       "time_per_step_ms": avg / args.output_len * 1000,
                                       "percentiles": percentiles})
    return 0


LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def latency_percentiles(latencies: list[float]) -> dict[str, float]:
    """vLLM's bench latency percentiles: numpy's default (linear interpolation between the nearest ranks), keyed
    by the percent as text. (A nearest-rank pick with round() reported P50 of [1, 2] as 1, not 1.5.)"""
    from pagedllm.entrypoints.cli.bench_serve import _percentile

    return {str(p): _percentile(latencies, p) for p in LATENCY_PERCENTILES}
