"""CPU serving: `pagedllm serve` (the GGUF kept packed, the default) vs llama-cpp-python's OpenAI server on the
same .gguf, N concurrent streaming clients, both servers up for the whole run and measured alternately,
round by round, reported as ratios of aggregate output tok/s.

    python benchmarks/cpu_gguf_serve.py --llama-python /work/wt/wt21-peers/llama/bin/python \\
        --concurrency 8,32 --rounds 2

Each client sends `--requests-per-client` text completions (a seeded ~100-token English-word prompt each,
`--output-len` tokens out, greedy, EOS and the chat end token banned by logit_bias on both sides, streamed).
Failed requests (an HTTP error or a dropped stream) are counted and reported; the aggregate counts only the
tokens that arrived. Both sides get `--threads` threads (llama.cpp n_threads; pagedllm OMP/torch threads).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _server import start_server  # noqa: E402

from pagedllm.entrypoints.server_process import free_port  # noqa: E402

_WORDS = ("the a river mountain city quiet people music garden winter summer light old new small great story "
          "water road house friend morning evening market teacher child window bridge forest letter journey "
          "village ocean storm bright silver green stone paper simple careful open close remember write read "
          "build travel listen follow learn begin finish across under between before after because while").split()


def wait_ready(base_url: str, proc: subprocess.Popen, timeout: float = 600.0) -> float:
    import httpx
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base_url + "/v1/models", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(base_url)


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Story {i}: " + " ".join(rng.choice(_WORDS) for _ in range(words)) for i in range(n)]


async def run_clients(base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                      banned: list[int]) -> dict:
    import httpx

    from pagedllm.entrypoints.cli.bench_serve import _one_request, summarize
    url = base_url + "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def go(prompt: str):
            payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True},
                       "logit_bias": {str(t): -100 for t in banned}}
            async with sem:
                return await _one_request(client, url, payload, {}, 0, False)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(go(p) for p in prompts))
        duration = time.perf_counter() - t0
    m = summarize(results, duration)
    m["errors"] = m.get("errors", [])[:3]
    # A stream the server closed early still "succeeds" over HTTP: count the requests that got every token.
    m["full"] = sum(1 for r in results if r.success and r.output_tokens >= max_tokens)
    return m


def uptime() -> str:
    try:
        with open("/proc/loadavg") as f:
            return "load " + " ".join(f.read().split()[:3])
    except OSError:
        return "load ?"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled SmolLM2 Q4_1)")
    p.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python[server]")
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=80)
    p.add_argument("--peer-omp-wait-policy", default=None, choices=["PASSIVE", "ACTIVE"],
                   help="OMP_WAIT_POLICY for llama.cpp's server (default: its own default)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pagedllm-args", default="", help="extra `pagedllm serve` flags")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from pagedllm.models.loader import resolve_model_path
    path = resolve_model_path(args.model)
    theirs_port = free_port()
    # Both servers get this environment (pagedllm leaves it alone): `pagedllm serve` applies its own OpenMP wait
    # policy to its own processes, llama.cpp runs with its default unless the user exported one or passes
    # --peer-omp-wait-policy.
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    peer_env = dict(env, **({"OMP_WAIT_POLICY": args.peer_omp_wait_policy} if args.peer_omp_wait_policy else {}))
    print(f"OMP_WAIT_POLICY: pagedllm serve {env.get('OMP_WAIT_POLICY') or 'its own (a short spin)'}, llama.cpp "
          f"{peer_env.get('OMP_WAIT_POLICY', 'unset (its default)')}", flush=True)
    # Both started at once, waited for below (wait_ready: the time each takes to serve /v1/models).
    ours = start_server(path, args.pagedllm_args.split(), "/tmp/cpu_gguf_serve_pagedllm.log", quiet=False, env=env,
                        wait=False)
    peer_log = open("/tmp/cpu_gguf_serve_llama.cpp.log", "w")
    procs = {
        "pagedllm": ours.proc,
        "llama.cpp": subprocess.Popen([args.llama_python, "-m", "llama_cpp.server", "--model", path, "--port",
                                       str(theirs_port), "--n_threads", str(args.threads), "--n_threads_batch",
                                       str(args.threads), "--n_ctx", "4096", "--verbose", "False"],
                                      env=peer_env, stdout=peer_log, stderr=subprocess.STDOUT),
    }
    urls = {"pagedllm": ours.url, "llama.cpp": f"http://127.0.0.1:{theirs_port}"}
    results: dict = {}
    try:
        for name, proc in procs.items():
            print(f"[{name}] ready in {wait_ready(urls[name], proc):.1f} s", flush=True)
        import httpx
        models = {n: httpx.get(u + "/v1/models").json()["data"][0]["id"] for n, u in urls.items()}
        from pagedllm.tokenizer import get_tokenizer
        from pagedllm.models.loader import prepare_model_dir
        tok = get_tokenizer(prepare_model_dir(path))
        banned = sorted({t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"),
                                     tok.convert_tokens_to_ids("<|endoftext|>")) if isinstance(t, int) and t >= 0})
        warm = make_prompts(2, args.prompt_words, 99)
        for name in procs:  # warm-up
            asyncio.run(run_clients(urls[name], models[name], warm, 1, 8, banned))
        levels = [int(c) for c in args.concurrency.split(",")]
        for rnd in range(args.rounds):
            for c in levels:
                prompts = make_prompts(c * args.requests_per_client, args.prompt_words, 1000 * rnd + c)
                order = list(procs) if rnd % 2 == 0 else list(reversed(procs))
                for name in order:
                    before = uptime()
                    m = asyncio.run(run_clients(urls[name], models[name], prompts, c, args.output_len, banned))
                    m["load_before"], m["load_after"] = before, uptime()
                    results.setdefault(f"c{c}", {}).setdefault(name, []).append(m)
                    print(f"round {rnd} c={c} {name}: {m['output_throughput']:.1f} tok/s aggregate, "
                          f"{m['full']} of {len(prompts)} streams complete ({m['failed']} failed), {m['duration']:.1f} s ({before})"
                          + (f"; first error: {m['errors'][0]}" if m.get("errors") else ""), flush=True)
        for key, by_side in results.items():
            ratios = [a["output_throughput"] / max(b["output_throughput"], 1e-9)
                      for a, b in zip(by_side["pagedllm"], by_side["llama.cpp"])]
            print(f"{key}: pagedllm / llama.cpp server per round: " + ", ".join(f"{r:.2f}x" for r in ratios))
            results[key]["ratios"] = ratios
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M"), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
