"""The API tier's own CPU cost per streamed token: CPU seconds of the API server process(es) of a real
`pagedllm serve` (engine core in its own process, as always) divided by the tokens they streamed, under many
concurrent streaming clients.

    python benchmarks/api_tier_cost.py                          # tiny random model, SmolLM2's tokenizer
    python benchmarks/api_tier_cost.py --model default          # the bundled SmolLM2-135M GGUF itself (slow engine)
    python benchmarks/api_tier_cost.py --profile /tmp/api.prof  # + cProfile of the API process, top functions
    # before / after in one session, interleaved (each round starts one server per source tree):
    git archive BASE src | tar -x -C /tmp/base
    python benchmarks/api_tier_cost.py --src before=/tmp/base/src --src after=src --rounds 3

The default model is a tiny random Llama (2 layers, hidden 64) with SmolLM2-135M-Instruct's vocabulary and
tokenizer (taken from the bundled GGUF): the API process does exactly the work it does for SmolLM2 (a real BPE
tokenizer, 49,152 ids), while the engine steps are fast enough that a run takes seconds, not minutes.

Only the API processes' CPU time is counted (user + system, all their threads: the scheduler's nanosecond run
times from /proc/PID/task/*/schedstat where the kernel has them, else psutil's 10 ms ticks; --ticks forces those), read
after a warm-up and again after the measured streams; the engine core's and the clients' are printed beside it.
The API process also spends CPU when nothing happens (uvicorn's tick, the engine watchers: per second, not per
token), which a slow engine (a long run) would charge to each token: it is measured alone after the warm-up
(--idle-seconds) and taken out in the "net of idle" figure. How much one token costs depends on how many tokens a chunk carries (a server that falls behind sends fewer,
larger chunks), so tokens per chunk is printed too: compare runs at ~1 token per chunk.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# A profiled API process: the server runs with cProfile ready in its main thread (where the event loop is);
# SIGUSR1 starts it (after the warm-up), SIGUSR2 stops it and writes the stats, so start-up is not in them.
_PROFILED = ("import cProfile, signal, sys\n"
             "from pagedllm.entrypoints.cli.main import main\n"
             "import time\n"
             "prof = cProfile.Profile(time.thread_time)\n"
             "signal.signal(signal.SIGUSR1, lambda *_: prof.enable())\n"
             "def dump(*_):\n"
             "    prof.disable()\n"
             "    prof.dump_stats(sys.argv[1])\n"
             "signal.signal(signal.SIGUSR2, dump)\n"
             "main(sys.argv[2:])\n")


def tiny_smollm2_dir(out: str) -> str:
    """A config-only tiny Llama with SmolLM2's vocabulary, beside SmolLM2's tokenizer (served with dummy weights)."""
    import shutil

    from pagedllm.models.gguf import convert_gguf_to_hf
    from pagedllm.models.loader import default_model_path

    real = convert_gguf_to_hf(default_model_path())  # cached after the first conversion
    os.makedirs(out, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if os.path.exists(os.path.join(real, name)):
            shutil.copy(os.path.join(real, name), out)
    with open(os.path.join(real, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, dtype="float32")
    cfg.pop("torch_dtype", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def hiding_dir(tmp: str, modules: list[str]) -> str:
    """A directory of stand-ins that fail to import: first on a server's PYTHONPATH, the server runs as if those
    packages were not installed (uvicorn's `auto` loop and HTTP parser then fall back to asyncio and h11)."""
    path = os.path.join(tmp, "hide-" + "-".join(modules))
    os.makedirs(path, exist_ok=True)
    for name in modules:
        with open(os.path.join(path, name + ".py"), "w") as f:
            f.write(f"raise ImportError('{name} hidden by benchmarks/api_tier_cost.py')\n")
    return path


def start_server(src: Optional[str], flags: list[str], log_path: str, profile: Optional[str] = None):
    from pagedllm.entrypoints.server_process import free_port, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # flags first: they start with the model (a positional that --served-model-name's list would swallow)
    serve = ["serve", *flags, "--port", str(port), "--disable-uvicorn-access-log", "--log-level", "warning",
             "--served-model-name", "m"]
    if profile:
        cmd = [sys.executable, "-c", _PROFILED, profile, *serve]
    else:
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", *serve]
    env = dict(os.environ)
    if src:  # "DIR" or "DIR:HIDDEN_DIR" (hiding_dir first)
        env["PYTHONPATH"] = os.pathsep.join(reversed([os.path.abspath(p) for p in src.split(os.pathsep)])) \
            + os.pathsep + env.get("PYTHONPATH", "")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, url, timeout_s=900, log_path=log_path)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url


def stop_server(proc) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def server_processes(pid: int) -> tuple[list, list]:
    """(API processes, engine cores) of the server started as `pid`: with one API process the server's own
    process serves HTTP; with several, its children named pagedllm-api-N do."""
    import psutil

    root = psutil.Process(pid)
    children = root.children(recursive=True)
    apis = [p for p in children if p.name().startswith("pagedllm-api")] or [root]
    cores = [p for p in children if p.name().startswith("pagedllm-core")]
    return apis, cores


def cpu_seconds(procs: list, system_only: bool = False) -> float:
    """User + system CPU (or system only) from /proc/PID/stat through psutil: clock ticks (10 ms)."""
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.system if system_only else t.user + t.system
    return total


def cpu_seconds_ns(procs: list) -> Optional[float]:
    """The same CPU time at nanosecond resolution: the scheduler's run time of every live thread
    (/proc/PID/task/TID/schedstat, first field). A run of ~0.1 s of API CPU is a dozen psutil ticks, so the
    tick alone is +-8%; this is not. None where the kernel has no schedstat (then the ticks are used).
    A thread that ends between the two reads is not counted (the API process keeps its threads)."""
    total = 0
    try:
        for p in procs:
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                try:
                    with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
                except FileNotFoundError:  # the thread just ended
                    continue
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


async def one_stream(client, url: str, body: dict, chat: bool) -> tuple[int, int]:
    """(tokens, chunks that carried text) of one streaming request."""
    tokens = chunks = 0
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices") or ():
                piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                if piece:
                    chunks += 1
    return tokens, chunks


def request_bodies(n: int, mean_tokens: int, range_ratio: float, chat: bool, seed: int) -> list[dict]:
    """n streaming requests; output lengths uniform in mean * (1 -+ range_ratio), as `bench serve` draws them."""
    import random

    rng = random.Random(seed)
    lo, hi = max(1, int(mean_tokens * (1 - range_ratio))), max(1, int(mean_tokens * (1 + range_ratio)))
    bodies = []
    for _ in range(n):
        body = {"model": "m", "max_tokens": rng.randint(lo, hi), "ignore_eos": True, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        if chat:
            body["messages"] = [{"role": "user", "content": f"Tell me about the number {rng.randrange(10**6)}."}]
        else:  # random token ids, as `pagedllm bench serve` sends
            body["prompt"] = [rng.randrange(100, 20000) for _ in range(rng.randrange(16, 64))]
        bodies.append(body)
    return bodies


async def drive(client, url: str, streams: int, bodies: list[dict], chat: bool) -> tuple[int, int, float]:
    """`streams` clients at once, each sending its share of `bodies` one after another on its own connection
    (kept alive, as a benchmark client does). -> (tokens, chunks with text, seconds)."""
    path = url + ("/v1/chat/completions" if chat else "/v1/completions")

    async def worker(mine: list[dict]) -> tuple[int, int]:
        tokens = chunks = 0
        for body in mine:
            t, c = await one_stream(client, path, body, chat)
            tokens, chunks = tokens + t, chunks + c
        return tokens, chunks

    start = time.perf_counter()
    results = await asyncio.gather(*(worker(bodies[i::streams]) for i in range(streams)))
    return sum(t for t, _ in results), sum(c for _, c in results), time.perf_counter() - start


async def warm_and_measure(url: str, args: argparse.Namespace, apis: list, cores: list, proc, profile) -> dict:
    import httpx
    import psutil

    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        # warm-up: every connection is opened now (and the first requests fill the server's caches)
        await drive(client, url, args.streams, request_bodies(args.streams, 8, 0.0, args.chat, 1), args.chat)
        bodies = request_bodies(args.streams * args.requests_per_stream, args.max_tokens, args.range_ratio,
                                args.chat, args.seed)
        me = psutil.Process()
        # What the API process spends with nothing to do (uvicorn's tick, the engine watchers: per second, not
        # per token): measured on its own, and taken out of the per-token figure ("net"), so that a slow engine
        # (a long run) does not count as API cost per token.
        # The API figures read the scheduler's nanosecond run times where there are (cpu_seconds_ns), else ticks.
        precise = cpu_seconds_ns(apis) is not None and not args.ticks
        api_cpu = (lambda: cpu_seconds_ns(apis)) if precise else (lambda: cpu_seconds(apis))
        idle0, t0 = api_cpu(), time.perf_counter()
        await asyncio.sleep(args.idle_seconds)
        idle_rate = (api_cpu() - idle0) / (time.perf_counter() - t0)
        if profile:
            proc.send_signal(signal.SIGUSR1)
        samplers = []  # over the measured window only
        if args.perf:  # native and kernel stacks of every API thread
            samplers.append(subprocess.Popen(
                ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(args.perf_freq), "-g", "-o", args.perf,
                 "-p", ",".join(str(p.pid) for p in apis)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if args.py_spy:  # Python stacks of the API process (non-blocking: no native frames), collapsed, one line per stack
            samplers.append(subprocess.Popen(
                ["py-spy", "record", "--nonblocking", "--threads", "--idle", "--format", "raw",
                 "--rate", str(args.perf_freq), "-o", args.py_spy, "-p", str(apis[0].pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if samplers:
            await asyncio.sleep(1.0)  # they attach
        api0, core0, me0, sys0 = api_cpu(), cpu_seconds(cores), cpu_seconds([me]), cpu_seconds(apis, True)
        tick0 = cpu_seconds(apis)
        tokens, chunks, elapsed = await drive(client, url, args.streams, bodies, args.chat)
        api1, core1, me1, sys1 = api_cpu(), cpu_seconds(cores), cpu_seconds([me]), cpu_seconds(apis, True)
        tick1 = cpu_seconds(apis)
        for sampler in samplers:
            sampler.send_signal(signal.SIGINT)
            sampler.wait(60)
    api_s = api1 - api0
    net_s = max(0.0, api_s - idle_rate * elapsed)
    return {"api_idle_cpu_per_s": idle_rate, "api_net_us_per_token": net_s / max(1, tokens) * 1e6,
            "api_processes": len(apis), "requests": len(bodies), "tokens": tokens, "chunks": chunks,
            "seconds": elapsed, "output_tok_s": tokens / elapsed, "api_cpu_s": api_s, "api_system_cpu_s": sys1 - sys0,
            "api_us_per_token": api_s / max(1, tokens) * 1e6, "api_us_per_chunk": api_s / max(1, chunks) * 1e6,
            "api_us_per_request": api_s / max(1, len(bodies)) * 1e6,
            "tokens_per_chunk": tokens / max(1, chunks), "engine_cpu_s": core1 - core0, "client_cpu_s": me1 - me0,
            "api_cpu_s_ticks": tick1 - tick0, "api_cpu_source": "schedstat" if precise else "ticks"}


def measure(src: Optional[str], args: argparse.Namespace, tmp: str, tag: str, profile: Optional[str] = None) -> dict:
    proc, url = start_server(src, list(args.server_flags), os.path.join(tmp, f"server-{tag}.log"), profile)
    try:
        apis, cores = server_processes(proc.pid)
        result = asyncio.run(warm_and_measure(url, args, apis, cores, proc, profile))
        if profile:
            if os.path.exists(profile):
                os.remove(profile)
            proc.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 60
            while not os.path.exists(profile) and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1)  # the dump may still be being written
    finally:
        stop_server(proc)
    return {"src": src or "(current)", **result}


def print_profile(path: str, top: int) -> None:
    import pstats

    stats = pstats.Stats(path)
    for key in ("tottime", "cumulative"):
        print(f"--- API process, top {top} by {key} ---")
        stats.sort_stats(key).print_stats(top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="'default': the bundled SmolLM2-135M-Instruct GGUF; a path or id; unset: a tiny random "
                        "model with SmolLM2's tokenizer")
    p.add_argument("--streams", type=int, default=64, help="concurrent clients, one connection each")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=88, help="mean output length (ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.818, help="output lengths in mean * (1 -+ ratio)")
    p.add_argument("--chat", action="store_true", help="chat completions (default: completions, token-id prompts)")
    p.add_argument("--api-server-count", type=int, default=1)
    p.add_argument("--extra", default="", help="more `pagedllm serve` flags, one string")
    p.add_argument("--src", action="append", default=[], metavar="NAME=DIR",
                   help="a source tree to run the server from (PYTHONPATH); repeat to compare, interleaved")
    p.add_argument("--hide", action="append", default=[], metavar="NAME=MOD[,MOD]",
                   help="run --src NAME as if these packages were not installed (e.g. before=uvloop,httptools)")
    p.add_argument("--rounds", type=int, default=1, help="rounds over the --src trees")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-seconds", type=float, default=10.0,
                   help="measure the API processes' idle CPU rate this long after the warm-up")
    p.add_argument("--profile", default=None, help="cProfile the API process (one --src, one API process) into FILE")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--perf", default=None, metavar="FILE",
                   help="`perf record` the API process(es) over the measured window into FILE (one --src; read it "
                        "with `perf report -i FILE`); perf's own process is not counted, its sampling interrupts are")
    p.add_argument("--py-spy", default=None, metavar="FILE",
                   help="py-spy (installed separately) records the API process's Python stacks over the "
                        "measured window into FILE (collapsed stacks; one --src, one API process)")
    p.add_argument("--perf-freq", type=int, default=2000, help="samples per second of --perf and --py-spy")
    p.add_argument("--ticks", action="store_true",
                   help="API CPU from psutil's 10 ms ticks only (as before schedstat was read)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    trees = [tuple(s.split("=", 1)) if "=" in s else (s, s) for s in args.src] or [("current", None)]
    if args.profile and (len(trees) > 1 or args.api_server_count != 1):
        p.error("--profile takes one source tree and --api-server-count 1")
    if (args.perf or args.py_spy) and len(trees) > 1:
        p.error("--perf and --py-spy take one source tree (each round would overwrite the file)")
    if args.py_spy and args.api_server_count != 1:
        p.error("--py-spy takes --api-server-count 1")
    results: dict[str, list[dict]] = {name: [] for name, _ in trees}
    with tempfile.TemporaryDirectory(prefix="pagedllm-apicost-") as tmp:
        if args.model is None:
            model = [tiny_smollm2_dir(os.path.join(tmp, "model")), "--load-format", "dummy"]
        else:
            model = [] if args.model == "default" else [args.model]
        args.server_flags = model + [
            "--max-model-len", "1024", "--max-num-seqs", str(max(args.streams, 8)),
            "--kv-cache-memory-bytes", str(1 << 30), "--api-server-count", str(args.api_server_count),
            "--no-dashboard", *args.extra.split()]
        for spec in args.hide:
            name, mods = spec.split("=", 1)
            trees = [(n, (src or os.path.join(ROOT, "src")) + os.pathsep + hiding_dir(tmp, mods.split(",")))
                     if n == name else (n, src) for n, src in trees]
        for r in range(args.rounds):
            for name, src in trees:
                res = measure(src, args, tmp, f"{name}-{r}", args.profile)
                results[name].append(res)
                print(f"[round {r}] {name:<10} {res['api_us_per_token']:8.1f} us/token  "
                      f"(net of idle {res['api_net_us_per_token']:6.1f}; idle {res['api_idle_cpu_per_s'] * 1e3:.1f} ms/s)  "
                      f"{res['api_us_per_chunk']:8.1f} us/chunk  {res['api_us_per_request']:7.0f} us/request  "
                      f"{res['tokens_per_chunk']:.2f} tok/chunk  "
                      f"api {res['api_cpu_s']:.3f} s ({res['api_cpu_source']}; ticks {res['api_cpu_s_ticks']:.2f}, kernel {res['api_system_cpu_s']:.2f})  engine {res['engine_cpu_s']:.2f} s  "
                      f"client {res['client_cpu_s']:.2f} s  {res['tokens']} tokens in {res['seconds']:.1f} s "
                      f"({res['output_tok_s']:.0f} tok/s)", flush=True)
    print(f"\nAPI tier CPU per streamed token ({args.streams} streams x {args.requests_per_stream} requests, "
          f"{args.max_tokens} tokens on average, "
          f"{'chat' if args.chat else 'completions'}, {args.api_server_count} API process(es)); median of rounds:")
    medians, nets = {}, {}
    for name, runs in results.items():
        medians[name] = statistics.median(x["api_us_per_token"] for x in runs)
        nets[name] = statistics.median(x["api_net_us_per_token"] for x in runs)
        print(f"  {name:<10} {medians[name]:8.1f} us/token, net of idle {nets[name]:8.1f}   (rounds: "
              + ", ".join(f"{x['api_us_per_token']:.1f} / {x['api_net_us_per_token']:.1f}" for x in runs)
              + ")  tokens/chunk " + ", ".join(f"{x['tokens_per_chunk']:.2f}" for x in runs))
    if len(medians) == 2:
        (a, va), (b, vb) = medians.items()
        print(f"  {a} / {b}: {va / vb:.2f}x, net of idle {nets[a] / max(nets[b], 1e-9):.2f}x")
    if args.profile:
        print_profile(args.profile, args.top)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
