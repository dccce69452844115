"""`pagedllm bench serve`: a streaming load generator for any OpenAI-compatible server.

Random prompts of exact token lengths are drawn from the model's vocabulary (the model's tokenizer when
it is readable locally, else token ids seen through the server's /tokenize) and sent as token-id prompts
to /v1/completions, so every server sees exactly the same tokens. Prints vLLM's result block.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

_SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog while the committee debated the annual budget for roads, "
    "schools, hospitals and parks. Scientists measured temperature, pressure and humidity in seventeen cities "
    "across four continents; their findings surprised many engineers, teachers and farmers alike."
)


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--backend", default="openai", choices=["openai", "vllm", "openai-chat"],
                   help="openai/vllm: /v1/completions with token-id prompts; openai-chat: /v1/chat/completions")
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (overrides host/port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="default /v1/completions (/v1/chat/completions for openai-chat)")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--tokenizer", default=None, help="tokenizer to draw prompts from (default: the model's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are drawn uniformly from [len*(1-r), len*(1+r)]")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--save-result", action="store_true", help="write the results as JSON")
    p.add_argument("--result-filename", "--save-result-file", dest="result_filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per request")
    return p


# ---- prompts ---------------------------------------------------------------------------------------------


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    prompt: Optional[str] = None  # text form, for chat backends


def sample_lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def sample_random_requests(token_pool: list[int], num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float, seed: int) -> list[BenchRequest]:
    """Deterministic in (token_pool, lengths, seed): the offline benchmark draws the very same prompts."""
    rng = random.Random(seed)
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    return [BenchRequest([rng.choice(token_pool) for _ in range(n_in)], n_out)
            for n_in, n_out in zip(in_lens, out_lens)]


def vocab_token_pool(tokenizer: Any) -> list[int]:
    """All ordinary token ids of the tokenizer (special tokens excluded)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = set((getattr(tokenizer, "get_added_vocab", lambda: {})() or {}).values())
    return [i for i in range(len(tokenizer)) if i not in special and i not in added]


# ---- one request -----------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one_request(client: Any, url: str, payload: dict, headers: dict, prompt_len: int,
                       chat: bool) -> RequestResult:
    res = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    last = start
    usage_tokens = None
    num_chunks = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message"))
                    return res
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                choices = obj.get("choices") or []
                if not choices:
                    continue
                piece = choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")
                if not piece:
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                num_chunks += 1
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
    res.success = True
    return res


# ---- the run ---------------------------------------------------------------------------------------------


def _percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


async def run_benchmark(base_url: str, model: str, requests: list[BenchRequest], *, max_concurrency: Optional[int],
                        request_rate: float = float("inf"), api_key: Optional[str] = None, ignore_eos: bool = False,
                        temperature: float = 0.0, backend: str = "openai", endpoint: Optional[str] = None,
                        seed: int = 0, disable_tqdm: bool = False, timeout: float = 3600.0) -> tuple[dict, list]:
    import httpx

    chat = backend == "openai-chat"
    url = base_url.rstrip("/") + (endpoint or ("/v1/chat/completions" if chat else "/v1/completions"))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests) or 1
    semaphore = asyncio.Semaphore(limit)
    bar = None
    if not disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="bench serve", dynamic_ncols=True, file=sys.stderr)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:

        async def go(req: BenchRequest) -> RequestResult:
            payload: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": temperature,
                                       "stream": True, "stream_options": {"include_usage": True}}
            if ignore_eos:
                payload["ignore_eos"] = True
            if chat:
                payload["messages"] = [{"role": "user", "content": req.prompt or ""}]
            else:
                payload["prompt"] = req.prompt_token_ids
            async with semaphore:
                r = await _one_request(client, url, payload, headers, len(req.prompt_token_ids), chat)
            if bar is not None:
                bar.update(1)
            return r

        tasks = []
        start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(go(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return summarize(results, duration), results


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "errors": [r.error for r in results if not r.success][:10],
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", [r.latency for r in ok])):
        out[f"mean_{name}_ms"] = _mean(values) * 1000
        out[f"median_{name}_ms"] = _percentile(values, 50) * 1000
        out[f"std_{name}_ms"] = (_mean([(v - _mean(values)) ** 2 for v in values]) ** 0.5) * 1000 if values else 0.0
        for p in (90, 95, 99):
            out[f"p{p}_{name}_ms"] = _percentile(values, p) * 1000
    return out


def format_result(m: dict, max_concurrency: Optional[int], request_rate: float,
                  percentile_metrics: str = "ttft,tpot,itl", percentiles: str = "99") -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append("{:<40} {:<10{}}".format(label, value, fmt))

    row("Successful requests:", m["completed"])
    if m["failed"]:
        row("Failed requests:", m["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")
    titles = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
              "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
    for name in [x.strip() for x in percentile_metrics.split(",") if x.strip() in titles]:
        title, short = titles[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", m[f"median_{name}_ms"], ".2f")
        for p in [x.strip() for x in percentiles.split(",") if x.strip()]:
            pf = float(p)
            key = f"p{int(pf) if pf.is_integer() else p}_{name}_ms"
            if key not in m:
                m[key] = 0.0
            row(f"P{p} {short} (ms):", m[key], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def _server_info(base_url: str, api_key: Optional[str]) -> list[dict]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json().get("data", [])


def _token_pool(args: argparse.Namespace, base_url: str, root: Optional[str]) -> tuple[list[int], Any]:
    import os

    source = args.tokenizer or (root if root and os.path.exists(root) else None)
    if source:
        from pagedllm.tokenizer import get_tokenizer

        tok = get_tokenizer(source)
        return vocab_token_pool(tok), tok
    import httpx  # the tokenizer is not readable here: use the ids the server's own /tokenize gives

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    r = httpx.post(base_url.rstrip("/") + "/tokenize", json={"prompt": _SAMPLE_TEXT, "add_special_tokens": False},
                   headers=headers, timeout=30)
    r.raise_for_status()
    return sorted(set(r.json()["tokens"])), None


def run(args: argparse.Namespace) -> int:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    if base_url.rstrip("/").endswith("/v1"):
        base_url = base_url.rstrip("/")[:-3]
    try:
        models = _server_info(base_url, args.api_key)
    except Exception as e:  # noqa: BLE001
        print(f"error: cannot reach the server at {base_url}: {e}", file=sys.stderr)
        return 1
    model = args.model or (models[0]["id"] if models else None)
    root = next((m.get("root") for m in models if m.get("id") == model), None)
    pool, tok = _token_pool(args, base_url, root)
    requests = sample_random_requests(pool, args.num_prompts, args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, args.seed)
    if args.backend == "openai-chat":
        if tok is None:
            print("error: --backend openai-chat needs --tokenizer (to turn random tokens into text)", file=sys.stderr)
            return 1
        for r in requests:
            r.prompt = tok.decode(r.prompt_token_ids)
    print(f"Benchmarking {model} at {base_url}: {len(requests)} prompts, max concurrency "
          f"{args.max_concurrency}, request rate {args.request_rate}", file=sys.stderr)
    metrics, _ = asyncio.run(run_benchmark(
        base_url, model, requests, max_concurrency=args.max_concurrency, request_rate=args.request_rate,
        api_key=args.api_key, ignore_eos=args.ignore_eos, temperature=args.temperature, backend=args.backend,
        endpoint=args.endpoint, seed=args.seed, disable_tqdm=args.disable_tqdm, timeout=args.timeout))
    print(format_result(metrics, args.max_concurrency, args.request_rate, args.percentile_metrics,
                        args.metric_percentiles), flush=True)
    if metrics["errors"]:
        print("First errors: " + "; ".join(metrics["errors"][:3]), file=sys.stderr)
    if args.save_result or args.result_filename:
        path = args.result_filename or f"bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
        result = dict(metrics, model=model, base_url=base_url, num_prompts=args.num_prompts,
                      max_concurrency=args.max_concurrency, request_rate=str(args.request_rate),
                      random_input_len=args.random_input_len, random_output_len=args.random_output_len,
                      random_range_ratio=args.random_range_ratio, seed=args.seed, date=time.strftime("%Y%m%d-%H%M%S"))
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"Saved results to {path}", file=sys.stderr)
    return 0 if metrics["completed"] == len(requests) else 1


__all__ = ["BenchRequest", "sample_random_requests", "vocab_token_pool", "run_benchmark", "format_result", "asdict"]
