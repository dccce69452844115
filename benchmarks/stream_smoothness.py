"""Streaming smoothness under many concurrent streams: per-stream inter-chunk gaps and tokens per chunk, against
the real `pagedllm serve`.

Each stream is a raw-HTTP streaming completion (ignore_eos, fixed max_tokens) with
`stream_options.continuous_usage_stats`, so every SSE chunk says how many tokens the stream has so far. A smooth
server sends every engine step's token as its own chunk as soon as the step ends: tokens per chunk ~1.0 and the
inter-chunk gap ~ the engine's step time. An API process that falls behind (detokenization, SSE framing, the event
loop) shows as chunks carrying several tokens and as long gaps followed by bursts.

    python benchmarks/stream_smoothness.py --streams 256 --max-tokens 64            # tiny random model, CPU
    python benchmarks/stream_smoothness.py --model benchmarks/configs/qwen3-0.6b --load-format dummy \\
        --synthetic-tokenizer --dtype bfloat16 --streams 256 --max-tokens 256     # GPU
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _server import start_server  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


async def one_stream(client, url: str, model: str, prompt: str, max_tokens: int, texts: Optional[list] = None
                     ) -> list[tuple[float, int]]:
    """[(arrival time, tokens so far)] for every chunk that carried tokens (the text, appended to texts)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    arrivals: list[tuple[float, int]] = []
    seen = 0
    text = []
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or {}
            n = usage.get("completion_tokens", seen)
            text += [c.get("text", "") for c in chunk.get("choices") or ()]
            if chunk.get("choices") and n > seen:
                arrivals.append((time.perf_counter(), n))
                seen = n
    if texts is not None:
        texts.append("".join(text))
    return arrivals


async def measure(url: str, model: str, num_streams: int, max_tokens: int, prompt: str = "Hello",
                  texts: Optional[list] = None) -> dict:
    """Start num_streams streams at once; per-stream chunk statistics over all of them (and each stream's text,
    appended to texts, and its chunk count, in the result's "chunks_per_stream")."""
    import httpx

    limits = httpx.Limits(max_connections=num_streams + 8, max_keepalive_connections=num_streams + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        streams = await asyncio.gather(*(one_stream(client, url, model, prompt, max_tokens, texts)
                                         for _ in range(num_streams)))
        elapsed = time.perf_counter() - start
    gaps, per_chunk, max_burst = [], [], 0
    for arrivals in streams:
        prev_n = 0
        for j, (t, n) in enumerate(arrivals):
            per_chunk.append(n - prev_n)
            max_burst = max(max_burst, n - prev_n)
            prev_n = n
            if j:
                gaps.append((t - arrivals[j - 1][0]) * 1e3)
    tokens = sum(per_chunk)
    return {
        "streams": num_streams, "max_tokens": max_tokens, "seconds": elapsed, "tokens": tokens,
        "complete_streams": sum(1 for a in streams if a and a[-1][1] == max_tokens),
        "chunks": len(per_chunk), "tokens_per_chunk": tokens / max(1, len(per_chunk)),
        "multi_token_chunk_share": sum(1 for c in per_chunk if c > 1) / max(1, len(per_chunk)),
        "max_tokens_in_chunk": max_burst,
        "gap_ms_p50": percentile(gaps, 50), "gap_ms_p90": percentile(gaps, 90), "gap_ms_p99": percentile(gaps, 99),
        "gap_ms_max": max(gaps, default=0.0), "output_tok_s": tokens / elapsed,
        "chunks_per_stream": [len(a) for a in streams],
    }


def tiny_model_dir(vocab: int = 2048) -> str:
    """A tiny random Qwen3 (config only; dummy weights) with a synthetic tokenizer beside it."""
    from structured_output_throughput import synthetic_tokenizer

    out = synthetic_tokenizer(vocab)
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "configs", "qwen3-0.6b", "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, vocab_size=vocab, bos_token_id=0, eos_token_id=vocab - 1,
               torch_dtype="float32", max_position_embeddings=4096)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: a tiny random model with a synthetic tokenizer")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--synthetic-tokenizer", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--extra", default="", help="more `pagedllm serve` flags, one string")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    model = args.model or tiny_model_dir()
    flags = ["--load-format", args.load_format, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
             "--max-num-seqs", str(max(args.streams, 1))]
    if args.synthetic_tokenizer:
        from serve_vs_offline import make_synthetic_tokenizer

        flags += ["--tokenizer", make_synthetic_tokenizer(model)]
    flags += args.extra.split()
    with tempfile.TemporaryDirectory(prefix="pagedllm-stream-") as tmp:
        server = start_server(model, ["--served-model-name", "m", *flags], os.path.join(tmp, "server.log"),
                              stop_signal=signal.SIGINT, stop_wait_s=30)
        try:
            asyncio.run(measure(server.url, "m", 4, 4))  # warm-up
            result = asyncio.run(measure(server.url, "m", args.streams, args.max_tokens))
        finally:
            server.stop()
    for k, v in result.items():
        if k == "chunks_per_stream":
            v = f"min {min(v)} / max {max(v)}"
        print(f"{k:<26} {v:.3f}" if isinstance(v, float) else f"{k:<26} {v}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
