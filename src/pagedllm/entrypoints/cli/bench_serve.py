"""`pagedllm bench serve`: a streaming load generator for any OpenAI-compatible server.

Random prompts of exact token lengths are drawn from the model's vocabulary (the model's tokenizer when
it is readable locally, else token ids seen through the server's /tokenize) and sent as token-id prompts
to /v1/completions, so every server sees exactly the same tokens. Prints vLLM's result block, and how many
tokens each streamed chunk carried (from the usage every chunk has with `stream_options.continuous_usage_stats`,
which vLLM and pagedllm send; `--no-chunk-usage` asks for it only at the end, as plain OpenAI servers need): a
server that falls behind sends few chunks of many tokens, a stream that streams one or two tokens per chunk.

`--plot FILE` / `--plot-dir DIR` draw the latency distributions and the throughput over time (bench_plots.py,
matplotlib). Several request rates (`--request-rate 1,2,4,inf`, or `pagedllm bench sweep`) run one after another,
each with its own prompts (seed + its index: no prefix-cache hits from the rate before), and print a table of
throughput and latency per rate; the plot is then the throughput-latency curve.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from pagedllm.entrypoints.cli import bench_client
from pagedllm.entrypoints.cli.arg_types import (existing_path_or_repo, http_url, non_negative_float, output_dir,
                                                output_file, output_problem, percentiles, positive_float,
                                                positive_int, tcp_port, unit_fraction, write_json)

_SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog while the committee debated the annual budget for roads, "
    "schools, hospitals and parks. Scientists measured temperature, pressure and humidity in seventeen cities "
    "across four continents; their findings surprised many engineers, teachers and farmers alike."
)


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--backend", default="openai", choices=["openai", "vllm", "openai-chat"],
                   help="openai/vllm: /v1/completions with token-id prompts; openai-chat: /v1/chat/completions")
    p.add_argument("--base-url", type=http_url, default=None,
                   help="server root, e.g. http://127.0.0.1:8000 (overrides host/port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=tcp_port, default=8000)
    p.add_argument("--endpoint", default=None, help="default /v1/completions (/v1/chat/completions for openai-chat)")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--tokenizer", type=existing_path_or_repo, default=None,
                   help="tokenizer to draw prompts from (default: the model's)")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--num-prompts", type=positive_int, default=1000)
    p.add_argument("--max-concurrency", type=positive_int, default=None)
    p.add_argument("--request-rate", type=request_rates, default=[float("inf")], metavar="RATE[,RATE...]",
                   help="requests/s (Poisson); inf = all at once; several, comma-separated: a sweep")
    p.add_argument("--random-input-len", type=positive_int, default=1024)
    p.add_argument("--random-output-len", type=positive_int, default=128)
    p.add_argument("--random-range-ratio", type=unit_fraction, default=0.0,
                   help="lengths are drawn uniformly from [len*(1-r), len*(1+r)]")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chunk-usage", dest="chunk_usage", action="store_false",
                   help="do not ask for the usage on every chunk (continuous_usage_stats): servers that refuse it; "
                        "tokens per chunk are then not measured")
    p.add_argument("--percentile-metrics", type=percentile_metrics, default="ttft,tpot,itl",
                   help="comma-separated, of " + ", ".join(PERCENTILE_METRICS))
    p.add_argument("--metric-percentiles", type=percentiles, default="99")
    p.add_argument("--save-result", action="store_true", help="write the results as JSON")
    p.add_argument("--result-filename", "--save-result-file", dest="result_filename", type=output_file, default=None,
                   help="where --save-result writes (default: bench-serve-<date>.json here); missing folders are made")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--client-processes", type=positive_int, default=None, metavar="N",
                   help="client processes sharing the requests and the concurrency (default: one per 128 concurrent "
                        "streams, at most a quarter of the cores): one Python process cannot read tens of thousands "
                        "of chunks a second")
    p.add_argument("--timeout", type=positive_float, default=6 * 3600, help="seconds per request")
    p.add_argument("--plot", type=output_file, default=None, metavar="FILE.png",
                   help="write the latency distributions and throughput over time (a sweep: its curves) as a PNG; "
                        "needs matplotlib (pip install 'pagedllm[plot]')")
    p.add_argument("--plot-dir", type=output_dir, default=None, metavar="DIR",
                   help="write one PNG per plot into DIR (ttft, tpot, itl, e2el, throughput, summary; a sweep: "
                        "sweep.png and rate-<r>.png)")
    return p


SWEEP_RATES = "1,2,4,8,inf"


def add_sweep_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_args(p)
    p.set_defaults(request_rate=request_rates(SWEEP_RATES))
    p.description = ("run `bench serve` at each request rate (--request-rate, default " + SWEEP_RATES + "), print "
                     "throughput and latency per rate, and plot the throughput-latency curve with --plot")
    return p


PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile_metrics(text: str) -> str:
    """Comma-separated names of PERCENTILE_METRICS: an unknown one is refused (it was left out of the results)."""
    unknown = [name.strip() for name in text.split(",") if name.strip() not in PERCENTILE_METRICS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown metric {', '.join(repr(n) for n in unknown)}; the metrics are "
                                         + ", ".join(PERCENTILE_METRICS))
    return text


def request_rates(text: str) -> list[float]:
    """"8" -> [8.0]; "1,2,inf" -> [1.0, 2.0, inf]; argparse's error for anything not a positive rate."""
    rates = []
    for part in str(text).split(","):
        try:
            rate = float(part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a request rate (a number of requests/s, "
                                             "or inf)") from None
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"request rates must be > 0 (or inf), got {part.strip()}")
        rates.append(rate)
    return rates


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


RequestResult = bench_client.RequestResult  # one record of a request, whichever client read it


async def _one_request(client: Any, url: str, payload: dict, headers: dict, prompt_len: int,
                       chat: bool) -> RequestResult:
    """One streaming request through an httpx client; its SSE events recorded as the raw client records them."""
    res = RequestResult(prompt_len=prompt_len)
    res.start_time = time.perf_counter()
    recorder = bench_client.StreamRecorder(res, chat, json.loads)
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            # Lines split at LF only, as SSE does: httpx's aiter_lines also splits at U+2028 and the like, which a
            # server may leave raw inside an event's JSON.
            pending = b""
            async for chunk in resp.aiter_bytes():
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.startswith(b"data:"):
                        recorder.on_data(line[5:].strip(), time.perf_counter())
                if recorder.done:
                    break
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
        return res
    recorder.finish(time.perf_counter())
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


def run_benchmark(base_url: str, model: str, requests: list[BenchRequest], *, max_concurrency: Optional[int],
                  request_rate: float = float("inf"), api_key: Optional[str] = None, ignore_eos: bool = False,
                  temperature: float = 0.0, backend: str = "openai", endpoint: Optional[str] = None,
                  seed: int = 0, disable_tqdm: bool = False, timeout: float = 3600.0,
                  chunk_usage: bool = True, client_processes: Optional[int] = None,
                  percentiles: str = "99") -> tuple[dict, list]:
    """Stream every request to the server; (metrics, RequestResults). A plain-HTTP server is driven by
    bench_client's raw client in `client_processes` processes (None: bench_client.client_processes_for the
    concurrency); an https one through httpx, in this process."""
    chat = backend == "openai-chat"
    url = base_url.rstrip("/") + (endpoint or ("/v1/chat/completions" if chat else "/v1/completions"))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests) or 1
    stream_options = {"include_usage": True, **({"continuous_usage_stats": True} if chunk_usage else {})}
    payloads = []
    for req in requests:
        payload: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": temperature,
                                   "stream": True, "stream_options": stream_options}
        if ignore_eos:
            payload["ignore_eos"] = True
        if chat:
            payload["messages"] = [{"role": "user", "content": req.prompt or ""}]
        else:
            payload["prompt"] = req.prompt_token_ids
        payloads.append(payload)
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    bar = None
    if not disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="bench serve", dynamic_ncols=True, file=sys.stderr)

    def progress(done: int) -> None:
        bar.update(done - bar.n)

    try:
        if bench_client.plain_http_target(url, headers) is None:
            if client_processes not in (None, 1):
                raise ValueError(f"--client-processes > 1 needs a plain http:// server URL, not {base_url}")
            results, duration = asyncio.run(_run_httpx(url, headers, payloads, prompt_lens, chat, limit,
                                                       request_rate, seed, timeout, bar))
            stats = None
        else:
            processes = client_processes or bench_client.client_processes_for(limit)
            results, duration, stats = bench_client.run_processes(
                url, headers, payloads, prompt_lens, chat=chat, limit=limit, request_rate=request_rate, seed=seed,
                timeout=timeout, processes=processes, progress=progress if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    metrics = summarize(results, duration, percentiles)
    if stats is not None:
        metrics["client_processes"] = stats.processes
        metrics["client_busiest_cpu"] = stats.busiest
    return metrics, results


async def _run_httpx(url: str, headers: dict, payloads: list[dict], prompt_lens: list[int], chat: bool, limit: int,
                     request_rate: float, seed: int, timeout: float, bar: Any) -> tuple[list, float]:
    import httpx

    semaphore = asyncio.Semaphore(limit)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:

        async def go(payload: dict, prompt_len: int) -> RequestResult:
            async with semaphore:
                r = await _one_request(client, url, payload, headers, prompt_len, chat)
            if bar is not None:
                bar.update(1)
            return r

        tasks = []
        start = time.perf_counter()
        for payload, prompt_len in zip(payloads, prompt_lens):
            tasks.append(asyncio.create_task(go(payload, prompt_len)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


def _percentile_key(p: str) -> str:
    """"99" / "99.0" -> "p99", "99.9" / "99.90" -> "p99.9" (the names of the result's and the JSON's keys, as
    vLLM's: the float's own text, so "99.90" is not a key of its own that vLLM's readers would not find)."""
    value = float(p)
    return f"p{int(value) if value.is_integer() else value}"


def summarize(results: list[RequestResult], duration: float, percentiles: str = "99") -> dict:
    """percentiles: --metric-percentiles (comma-separated), computed besides P90 / P95 / P99."""
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
        mean = _mean(values)  # once: recomputed per value it made summarize quadratic (minutes at 400k ITLs)
        out[f"std_{name}_ms"] = (_mean([(v - mean) ** 2 for v in values]) ** 0.5) * 1000 if values else 0.0
        for p in ["90", "95", "99", *(x for x in percentiles.split(",") if x.strip())]:
            out[f"{_percentile_key(p)}_{name}_ms"] = _percentile(values, float(p)) * 1000
    # Tokens per chunk, over every content chunk of the requests whose every chunk carried its usage.
    per_chunk = [n for r in ok for n in r.chunk_tokens]
    out["chunk_tokens_measured"] = bool(per_chunk)
    out["mean_tokens_per_chunk"] = _mean(per_chunk)
    out["median_tokens_per_chunk"] = _percentile(per_chunk, 50)
    for p in (90, 99):
        out[f"p{p}_tokens_per_chunk"] = _percentile(per_chunk, p)
    out["max_tokens_per_chunk"] = max(per_chunk, default=0)
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
    for name in [x.strip() for x in percentile_metrics.split(",")]:
        title, short = titles[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", m[f"median_{name}_ms"], ".2f")
        for p in [x.strip() for x in percentiles.split(",") if x.strip()]:
            key = _percentile_key(p)
            row(f"P{key[1:]} {short} (ms):", m[f"{key}_{name}_ms"], ".2f")
    if m.get("chunk_tokens_measured"):
        lines.append("{s:{c}^{n}}".format(s="Tokens per Chunk", n=50, c="-"))
        row("Mean tokens per chunk:", m["mean_tokens_per_chunk"], ".2f")
        row("Median tokens per chunk:", m["median_tokens_per_chunk"], ".2f")
        row("P99 tokens per chunk:", m["p99_tokens_per_chunk"], ".2f")
        row("Max tokens per chunk:", m["max_tokens_per_chunk"])
    if "client_processes" in m:
        from pagedllm.entrypoints.cli.bench_client import ClientStats

        lines.append("Client: " + ClientStats(m["client_processes"], m["client_busiest_cpu"]).describe())
    lines.append("=" * 50)
    return "\n".join(lines)


def _server_info(base_url: str, api_key: Optional[str]) -> list[dict]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json().get("data", [])


class BenchSetupError(Exception):
    """What the benchmark needs and could not get before it starts (its message is the error line)."""


def _token_pool(args: argparse.Namespace, base_url: str, root: Optional[str],
                tok: Any = None) -> tuple[list[int], Any]:
    """tok: the --tokenizer's, loaded already; else the model's where it is readable here, else the server's ids."""
    import os

    if tok is None and root and os.path.exists(root):
        from pagedllm.tokenizer import get_tokenizer

        try:
            tok = get_tokenizer(root)
        except ValueError as e:  # the model's folder holds no usable tokenizer: the server's ids still serve
            print(f"warning: {e}; using token ids from the server's /tokenize", file=sys.stderr)
    if tok is not None:
        return vocab_token_pool(tok), tok
    import httpx  # the tokenizer is not readable here: use the ids the server's own /tokenize gives

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.post(base_url.rstrip("/") + "/tokenize",
                       json={"prompt": _SAMPLE_TEXT, "add_special_tokens": False}, headers=headers, timeout=30)
        r.raise_for_status()
        tokens = r.json()["tokens"]
        if not tokens or not all(isinstance(t, int) for t in tokens):
            raise ValueError("no token ids")
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        # a server without vLLM's /tokenize (a plain OpenAI one): the prompts need a tokenizer named here
        why = (str(e).splitlines() or [""])[0]
        raise BenchSetupError(f"the model's tokenizer is not readable here and the server's /tokenize gave no "
                              f"token ids ({type(e).__name__}: {why}); pass --tokenizer") from None
    return sorted(set(tokens)), None


def _sampled_requests(args: argparse.Namespace, pool: list[int], tok: Any, seed: int) -> list[BenchRequest]:
    requests = sample_random_requests(pool, args.num_prompts, args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, seed)
    if args.backend == "openai-chat":
        for r in requests:
            r.prompt = tok.decode(r.prompt_token_ids)
    return requests


def _one_rate(args: argparse.Namespace, base_url: str, model: str, requests: list[BenchRequest], rate: float,
              seed: int) -> tuple[dict, list]:
    print(f"Benchmarking {model} at {base_url}: {len(requests)} prompts, max concurrency "
          f"{args.max_concurrency}, request rate {rate}", file=sys.stderr)
    metrics, results = run_benchmark(
        base_url, model, requests, max_concurrency=args.max_concurrency, request_rate=rate,
        api_key=args.api_key, ignore_eos=args.ignore_eos, temperature=args.temperature, backend=args.backend,
        endpoint=args.endpoint, seed=seed, disable_tqdm=args.disable_tqdm, timeout=args.timeout,
        chunk_usage=getattr(args, "chunk_usage", True), client_processes=getattr(args, "client_processes", None),
        percentiles=args.metric_percentiles)
    print(format_result(metrics, args.max_concurrency, rate, args.percentile_metrics,
                        args.metric_percentiles), flush=True)
    if metrics["errors"]:
        print("First errors: " + "; ".join(metrics["errors"][:3]), file=sys.stderr)
    return metrics, results


def format_sweep_table(rows: list[tuple[float, dict]]) -> str:
    head = ("rate (req/s)", "ok", "failed", "duration s", "req/s", "out tok/s", "TTFT med ms", "TTFT P99 ms",
            "TPOT med ms", "TPOT P99 ms", "ITL med ms", "ITL P99 ms", "tok/chunk P99")
    lines = [head]
    for rate, m in rows:
        lines.append(("inf" if rate == float("inf") else f"{rate:g}", str(m["completed"]), str(m["failed"]),
                      f"{m['duration']:.2f}", f"{m['request_throughput']:.2f}", f"{m['output_throughput']:.1f}",
                      *(f"{m[f'{stat}_{name}_ms']:.1f}" for name in ("ttft", "tpot", "itl")
                        for stat in ("median", "p99")),
                      f"{m['p99_tokens_per_chunk']:.1f}" if m.get("chunk_tokens_measured") else "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines]
    return "\n".join([" Request-rate sweep ".center(len(out[0]), "="), *out, "=" * len(out[0])])


def json_rate(rate: float) -> Any:
    """The request rate as vLLM's result file writes it: a number, or "inf" (JSON has no infinity). It was the
    text of the float ("8.0"), which a script comparing rates numerically could not read."""
    return "inf" if rate == float("inf") else rate


def _result_record(args: argparse.Namespace, metrics: dict, model: str, base_url: str, rate: float,
                   seed: int) -> dict:
    return dict(metrics, model=model, base_url=base_url, num_prompts=args.num_prompts,
                max_concurrency=args.max_concurrency, request_rate=json_rate(rate),
                random_input_len=args.random_input_len, random_output_len=args.random_output_len,
                random_range_ratio=args.random_range_ratio, seed=seed, date=time.strftime("%Y%m%d-%H%M%S"))


def run(args: argparse.Namespace) -> int:
    if not args.api_key:  # as vLLM's bench serve, which sends $OPENAI_API_KEY
        from pagedllm import envs

        args.api_key = envs.OPENAI_API_KEY or None
    plotting = bool(args.plot or args.plot_dir)
    if plotting:  # before anything runs: a missing matplotlib costs no benchmark and writes nothing
        from pagedllm.entrypoints.cli.bench_plots import PlotUnavailable, require_matplotlib

        try:
            require_matplotlib()
        except PlotUnavailable as e:
            print(e, file=sys.stderr)
            return 2
    rates: list[float] = list(args.request_rate)
    sweep = getattr(args, "sweep", False) or len(rates) > 1
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    if base_url.rstrip("/").endswith("/v1"):
        base_url = base_url.rstrip("/")[:-3]
    if (args.client_processes or 1) > 1 and not base_url.startswith("http://"):
        print(f"error: --client-processes > 1 needs a plain http:// server URL, not {base_url}", file=sys.stderr)
        return 2
    # Where the results go and the tokenizer, checked before the run: a failure after it would lose all its work.
    result_path = None
    if args.save_result or args.result_filename:
        result_path = (args.result_filename
                       or f"bench-{'sweep' if sweep else 'serve'}-{time.strftime('%Y%m%d-%H%M%S')}.json")
        problem = output_problem(result_path)
        if problem:
            print(f"error: cannot write the results to {result_path}: {problem}", file=sys.stderr)
            return 2
    tok = None
    if args.tokenizer:
        from pagedllm.tokenizer import get_tokenizer

        try:
            tok = get_tokenizer(args.tokenizer)
        except ValueError as e:
            print(f"error: --tokenizer {args.tokenizer}: {e}", file=sys.stderr)
            return 2
    try:
        models = _server_info(base_url, args.api_key)
    except Exception as e:  # noqa: BLE001
        print(f"error: cannot reach the server at {base_url}: {e}", file=sys.stderr)
        return 1
    model = args.model or (models[0]["id"] if models else None)
    if model is None:  # (was sent as "model": null in every request, each failing)
        print(f"error: the server at {base_url} lists no models in /v1/models; pass --model", file=sys.stderr)
        return 1
    root = next((m.get("root") for m in models if m.get("id") == model), None)
    try:
        pool, tok = _token_pool(args, base_url, root, tok)
    except BenchSetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.backend == "openai-chat" and tok is None:
        print("error: --backend openai-chat needs --tokenizer (to turn random tokens into text)", file=sys.stderr)
        return 1
    runs = []
    for i, rate in enumerate(rates):
        seed = args.seed + i  # each rate its own prompts: none is a prefix-cache hit of the rate before
        requests = _sampled_requests(args, pool, tok, seed)
        metrics, results = _one_rate(args, base_url, model, requests, rate, seed)
        runs.append((rate, metrics, results))
    if sweep:
        print(format_sweep_table([(rate, m) for rate, m, _ in runs]), flush=True)
    if result_path:
        records = [_result_record(args, m, model, base_url, rate, args.seed + i) for i, (rate, m, _) in enumerate(runs)]
        write_json(result_path, {"sweep": records} if sweep else records[0])
    if plotting:
        from pagedllm.entrypoints.cli.bench_plots import (serve_title, short_name, write_serve_plots,
                                                          write_sweep_plots)

        if sweep:
            title = (f"{short_name(model)}: {args.num_prompts} requests per rate, concurrency "
                     f"{args.max_concurrency or 'unlimited'}")
            written = write_sweep_plots(runs, title, args.plot, args.plot_dir)
        else:
            rate, metrics, results = runs[0]
            written = write_serve_plots(results, serve_title(metrics, model, args.max_concurrency, rate),
                                        args.plot, args.plot_dir)
        print("Wrote " + ", ".join(written), file=sys.stderr)
    return 0 if all(m["completed"] == args.num_prompts for _, m, _ in runs) else 1


def run_sweep(args: argparse.Namespace) -> int:
    args.sweep = True
    return run(args)


__all__ = ["BenchRequest", "sample_random_requests", "vocab_token_pool", "run_benchmark", "format_result",
           "format_sweep_table", "request_rates", "asdict"]
