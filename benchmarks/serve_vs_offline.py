"""Serving overhead: `pagedllm bench serve` at concurrency 32 against `pagedllm serve`, vs the offline engine
(`pagedllm.LLM`) on the very same prompts. Prints both output throughputs and their ratio (target >= 0.85).

    python benchmarks/serve_vs_offline.py [--model M] [--num-prompts 32] [--concurrency 32] [--api-server-count N]

Prompts: 32 random-token prompts, input and output lengths uniform in 16..160 (mean 88, range ratio 72/88),
ignore_eos, greedy. The server run and the offline run never overlap (the server is stopped first).

A model directory with only a config.json (benchmarks/configs/*, random weights) has no tokenizer:
--synthetic-tokenizer builds a byte-level one of the model's vocabulary size (as structured_output_throughput.py
does) and gives it to both sides. The issue-15 served workload on the GPU:

    python benchmarks/serve_vs_offline.py --model benchmarks/configs/qwen3-0.6b --load-format dummy \
        --synthetic-tokenizer --dtype bfloat16 --num-prompts 1024 --concurrency 256 --max-num-seqs 256 \
        --kv-cache-memory-bytes 0 --gpu-memory-utilization 0.9 --max-model-len 1024
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from _server import bench_serve_cmd, start_server

MEAN_LEN = 88
RANGE_RATIO = 72 / 88  # lengths in [16, 160]


def bench_cmd(url: str, num_prompts: int, concurrency: int, seed: int, result: str) -> list[str]:
    return bench_serve_cmd(url, num_prompts, concurrency, MEAN_LEN, MEAN_LEN, seed, result,
                           extra=["--random-range-ratio", str(RANGE_RATIO)])


def run_server_side(args: argparse.Namespace, engine_flags: list[str], tmp: str) -> dict:
    tok = ["--tokenizer", args.tokenizer] if args.tokenizer else []
    server = start_server(args.model, [*engine_flags, *tok], os.path.join(tmp, "server.log"),
                          stop_signal=signal.SIGINT, stop_wait_s=30)
    url = server.url
    try:
        # warm-up (different seed: no prefix-cache hits for the measured prompts)
        subprocess.run(bench_cmd(url, 4, 4, args.seed + 1000, os.path.join(tmp, "warm.json")) + tok, check=True,
                       stdout=subprocess.DEVNULL)
        result = os.path.join(tmp, "serve.json")
        out = subprocess.run(bench_cmd(url, args.num_prompts, args.concurrency, args.seed, result) + tok,
                             check=True, capture_output=True, text=True)
        print(out.stdout)
        with open(result) as f:
            return json.load(f)
    finally:
        server.stop()


def run_offline_side(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.cli.bench_serve import sample_random_requests, vocab_token_pool

    llm = LLM(model=args.model, **({"tokenizer": args.tokenizer} if args.tokenizer else {}), **engine_kwargs)
    pool = vocab_token_pool(llm.get_tokenizer())

    def requests(n: int, seed: int):
        return sample_random_requests(pool, n, MEAN_LEN, MEAN_LEN, RANGE_RATIO, seed)

    def params(reqs):
        return [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in reqs]

    warm = requests(4, args.seed + 1000)
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in warm], params(warm), use_tqdm=False)
    reqs = requests(args.num_prompts, args.seed)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params(reqs), use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    num_in = sum(len(r.prompt_token_ids) for r in reqs)
    return {"duration": elapsed, "total_output_tokens": num_out, "total_input_tokens": num_in,
            "output_throughput": num_out / elapsed}


def make_synthetic_tokenizer(model: str | None) -> str:
    if not model or not os.path.isfile(os.path.join(model, "config.json")):
        raise SystemExit("--synthetic-tokenizer needs --model DIR with a config.json")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from structured_output_throughput import synthetic_tokenizer

    with open(os.path.join(model, "config.json")) as f:
        return synthetic_tokenizer(int(json.load(f)["vocab_size"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--load-format", default="auto", help="'dummy' (random weights) needs only config + tokenizer")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory for both sides (default: the model's)")
    p.add_argument("--synthetic-tokenizer", action="store_true",
                   help="build a byte-level tokenizer of the model's vocabulary size (config-only model dirs)")
    p.add_argument("--target", type=float, default=0.90, help="server / offline ratio to pass (issue 15: 0.90)")
    p.add_argument("--api-server-count", type=int, default=None,
                   help="the server's API server processes (default: the server's own default for the machine)")
    args = p.parse_args()
    if args.synthetic_tokenizer:
        args.tokenizer = make_synthetic_tokenizer(args.model)
    engine_kwargs = {"max_model_len": args.max_model_len, "seed": args.seed, "load_format": args.load_format,
                     "dtype": args.dtype}
    engine_flags = ["--max-model-len", str(args.max_model_len), "--seed", str(args.seed), "--load-format",
                    args.load_format, "--dtype", args.dtype]
    for name in ("max_num_seqs", "gpu_memory_utilization"):
        if getattr(args, name) is not None:
            engine_kwargs[name] = getattr(args, name)
            engine_flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    server_flags = [] if args.api_server_count is None else ["--api-server-count", str(args.api_server_count)]
    if args.kv_cache_memory_bytes:  # 0: size the KV pool from --gpu-memory-utilization (GPU)
        engine_kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
        engine_flags += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    with tempfile.TemporaryDirectory(prefix="pagedllm-serve-bench-") as tmp:
        served = run_server_side(args, engine_flags + server_flags, tmp)
    offline = run_offline_side(args, engine_kwargs)
    if served["total_output_tokens"] != offline["total_output_tokens"]:
        print(f"warning: output tokens differ: server {served['total_output_tokens']} vs offline "
              f"{offline['total_output_tokens']}", file=sys.stderr)
    ratio = served["output_throughput"] / offline["output_throughput"]
    print("{s:{c}^{n}}".format(s=" Server vs offline ", n=50, c="="))
    print(f"{'Prompts / concurrency:':<40} {args.num_prompts} / {args.concurrency}")
    if args.api_server_count is not None:
        print(f"{'API server processes:':<40} {args.api_server_count}")
    print(f"{'Output tokens (server / offline):':<40} {served['total_output_tokens']} / {offline['total_output_tokens']}")
    print(f"{'Offline output throughput (tok/s):':<40} {offline['output_throughput']:.2f}")
    print(f"{'Server output throughput (tok/s):':<40} {served['output_throughput']:.2f}")
    verdict = "PASS" if ratio >= args.target else "FAIL"
    print(f"{'Server / offline:':<40} {ratio:.3f}  (target >= {args.target:.2f}: {verdict})")
    for key in ("mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "p99_itl_ms"):
        if key in served:
            print(f"{'Server ' + key + ':':<40} {served[key]:.2f}")
    print("=" * 50)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"server": served, "offline": offline, "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
