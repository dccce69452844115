"""Gateway overhead: `pagedllm bench serve` at concurrency 32 straight to one `pagedllm serve` replica vs through
nginx started from the repository's gateway config (deploy/nginx, the replica as its only upstream). Prints
both output throughputs and their ratio (target >= 0.95).

    python benchmarks/gateway_vs_direct.py [--model M] [--rounds 4] [--num-prompts 64] [--concurrency 32]

Runs alternate direct / gateway / gateway / direct ... against the same server (one warm-up first), so load
from other processes on a shared machine falls on both sides alike; every run has its own random-token
prompts (a distinct seed: no prefix-cache hits) of exact lengths, ignore_eos, greedy.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time

from _server import bench, cpu_seconds, start_server

from pagedllm.entrypoints.server_process import free_port, nginx_gateway_config, start_nginx

NGINX_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "nginx")


def wait_gateway(url: str, proc: subprocess.Popen, timeout_s: float = 30) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("nginx did not answer /health")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=4, help="pairs of runs (direct + gateway each)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagedllm-gateway-bench-") as tmp:
        served = start_server(args.model, ["--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes",
                                           str(args.kv_cache_memory_bytes), "--max-num-seqs",
                                           str(max(args.concurrency, 32))],
                              os.path.join(tmp, "server.log"))
        server, port, direct = served.proc, served.port, served.url
        listen = free_port()
        gateway = f"http://127.0.0.1:{listen}"
        nginx = None
        try:
            nginx = start_nginx(nginx_gateway_config(NGINX_DIR, os.path.join(tmp, "nginx"), listen, [port]),
                                os.path.join(tmp, "nginx.log"))
            wait_gateway(gateway, nginx)
            bench(direct, args, args.seed + 10_000, 8, os.path.join(tmp, "warm.json"))
            runs: dict[str, list[float]] = {"direct": [], "gateway": []}
            cpu = {"nginx": 0.0, "server": 0.0}  # CPU seconds spent during the gateway runs
            order = []
            for r in range(args.rounds):
                order += [("direct", direct), ("gateway", gateway)] if r % 2 == 0 else \
                         [("gateway", gateway), ("direct", direct)]
            for i, (side, url) in enumerate(order):
                before = (cpu_seconds(nginx.pid), cpu_seconds(server.pid))
                result = bench(url, args, args.seed + i, args.num_prompts, os.path.join(tmp, f"run{i}.json"))
                if side == "gateway":
                    cpu["nginx"] += cpu_seconds(nginx.pid) - before[0]
                    cpu["server"] += cpu_seconds(server.pid) - before[1]
                runs[side].append(result["output_throughput"])
                print(f"run {i:2d} {side:8s} output {result['output_throughput']:8.1f} tok/s, "
                      f"{result['completed']} requests in {result['duration']:.1f} s", flush=True)
        finally:
            if nginx is not None:
                nginx.send_signal(signal.SIGTERM)
                nginx.wait(10)
            served.stop()
    mean = {side: sum(v) / len(v) for side, v in runs.items()}
    ratio = mean["gateway"] / mean["direct"]
    pair_ratios = [g / d for d, g in zip(runs["direct"], runs["gateway"])]
    print("{s:{c}^{n}}".format(s=" Through nginx vs direct ", n=56, c="="))
    print(f"{'Prompts / concurrency / in / out:':<40} {args.num_prompts} / {args.concurrency} / "
          f"{args.input_len} / {args.output_len}")
    print(f"{'Direct output throughput (tok/s):':<40} {mean['direct']:.1f}  {[round(x, 1) for x in runs['direct']]}")
    gateway_runs = [round(x, 1) for x in runs["gateway"]]
    print(f"{'Gateway output throughput (tok/s):':<40} {mean['gateway']:.1f}  {gateway_runs}")
    print(f"{'Gateway / direct:':<40} {ratio:.3f}  (per round {[round(x, 3) for x in pair_ratios]}; "
          f"target >= 0.95: {'PASS' if ratio >= 0.95 else 'FAIL'})")
    print(f"{'nginx CPU / server CPU (gateway runs):':<40} {cpu['nginx']:.2f} s / {cpu['server']:.1f} s = "
          f"{cpu['nginx'] / max(cpu['server'], 1e-9):.2%}")
    print("=" * 56)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"runs": runs, "cpu": cpu, "ratio": ratio, "pair_ratios": pair_ratios, "args": vars(args)}, f,
                      indent=2)


if __name__ == "__main__":
    main()
