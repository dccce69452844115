"""What open dashboards cost the server: `pagedllm bench serve` (a fixed load) against one `pagedllm serve` with no
/dashboard page open and with N (default 5) pages' event streams open. Prints both output throughputs, their ratio
(target: within noise of 1, i.e. inside the spread of the runs themselves), the events each listener got per second,
the server's CPU seconds per generated token on each side, and, with no request running, the CPU share of the API
and engine-core processes without and with the listeners (the pages' own cost, whatever else loads the machine).

    python benchmarks/dashboard_cost.py [--model M] [--rounds 4] [--clients 5] [--num-prompts 64] [--concurrency 16]
    python benchmarks/dashboard_cost.py --micro     # the parts alone, in CPU time (no server; load-independent)

Runs alternate none / open / open / none ... against the same server (one warm-up first), so load from other
processes on a shared machine falls on both sides alike; every run has its own random-token prompts (a distinct
seed: no prefix-cache hits) of exact lengths, ignore_eos. The listeners run in a separate process (a browser would
not run on the server either), reading every event as a page does.
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

from _server import bench, cpu_seconds, server_cpu, start_server

# N listeners on /dashboard/events until SIGTERM; prints {"events": total, "seconds": s, "bytes": b} at the end.
LISTENERS = r"""
import asyncio, json, signal, sys, time
import httpx

url, n = sys.argv[1], int(sys.argv[2])
counts = {"events": 0, "bytes": 0}

async def listen(client):
    async with client.stream("GET", url + "/dashboard/events") as r:
        assert r.status_code == 200, r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])  # parsed, as the page does
                counts["events"] += 1
                counts["bytes"] += len(line)

async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with httpx.AsyncClient(timeout=None) as client:
        tasks = [asyncio.create_task(listen(client)) for _ in range(n)]
        start = time.monotonic()
        print("listening", flush=True)
        await stop.wait()
        seconds = time.monotonic() - start
        for t in tasks:
            t.cancel()
    print(json.dumps({**counts, "seconds": seconds}), flush=True)

asyncio.run(main())
"""


def idle_cost(pid: int, url: str, clients: int, seconds: float) -> dict:
    """CPU seconds per second of the API and engine processes with no request running, without and with
    `clients` listeners: what the pages cost by themselves, independent of the load on the machine."""
    out = {}
    for side, n in (("none", 0), ("open", clients)):
        listeners = start_listeners(url, n) if n else None
        time.sleep(1.0)  # the listeners' first events (and the sampler's start) are not counted
        api0, engine0 = server_cpu(pid)
        time.sleep(seconds)
        api1, engine1 = server_cpu(pid)
        got = stop_listeners(listeners) if listeners is not None else None
        out[side] = {"api": (api1 - api0) / seconds, "engine": (engine1 - engine0) / seconds,
                     "events_per_s": got["events"] / got["seconds"] / n if got else 0.0}
    return out


def start_listeners(url: str, n: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", LISTENERS, url, str(n)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc


def stop_listeners(proc: subprocess.Popen) -> dict:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    return json.loads(out.strip().splitlines()[-1])


def micro() -> None:
    """CPU time of the dashboard's parts per update, at pool sizes up to an H200's: the engine core's DashboardReply
    and the API process's grid cells + JSON. Thread CPU time, best of 5 repeats. (What block_states adds to the block
    pool's own operations, paid dashboard open or not: benchmarks/block_pool_ops.py.)"""
    import base64

    from pagedllm.core.block_pool import BlockPool
    from pagedllm.entrypoints import messages as m
    from pagedllm.entrypoints.dashboard import summary
    from pagedllm.entrypoints.dashboard.engine_side import dashboard_reply

    def best(fn, repeats: int = 5) -> float:
        times = []
        for _ in range(repeats):
            t = time.thread_time()
            fn()
            times.append(time.thread_time() - t)
        return min(times)

    class Sched:
        def __init__(self, pool: BlockPool) -> None:
            self.kv_cache_manager = type("KV", (), {"block_pool": pool})()
            self.waiting = []
            self.max_loras = None

    print("per dashboard update (every 0.25 s while a page is open), by pool size (us)")
    print(f"  {'blocks':>8s} {'engine: DashboardReply':>24s} {'API: cells + counts + JSON':>28s}")
    for n in (1_000, 10_000, 50_000, 100_000):
        pool = BlockPool(n)
        blocks = pool.allocate(n // 2)
        pool.free(blocks[: n // 4])
        core = type("Core", (), {"scheduler": Sched(pool)})()
        msg = m.GetDashboard(seq=1)
        enc, dec = m.Encoder(), m.output_decoder()
        engine_s = best(lambda: enc.encode(dashboard_reply(core, msg)))
        reply = dec.decode(enc.encode(dashboard_reply(core, msg)))

        def api() -> None:
            cells, k = summary.grid_cells(reply.block_states, 4096)
            json.dumps({"cells": base64.b64encode(cells).decode(), "k": k, **summary.state_counts(reply.block_states)})

        print(f"  {n:8,d} {engine_s * 1e6:24.1f} {best(api) * 1e6:28.1f}")


def main() -> None:
    if "--micro" in sys.argv[1:]:
        micro()
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=4, help="pairs of runs (none + open each)")
    p.add_argument("--clients", type=int, default=5, help="dashboard pages open on the 'open' side")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--idle-seconds", type=float, default=20.0, help="length of each idle CPU measurement")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `pagedllm serve` flag (repeatable)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    runs: dict[str, list[float]] = {"none": [], "open": []}
    idle: dict = {}
    cpu_per_token: dict[str, list[float]] = {"none": [], "open": []}
    listened: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-dashboard-bench-") as tmp:
        served = start_server(args.model, ["--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes",
                                           str(args.kv_cache_memory_bytes), "--max-num-seqs",
                                           str(max(args.concurrency, 32)), *args.serve_arg],
                              os.path.join(tmp, "server.log"))
        server, url = served.proc, served.url
        try:
            bench(url, args, args.seed + 10_000, 8, os.path.join(tmp, "warm.json"))
            # the sampler's first start (and the page's first event) happen before the measured runs
            stop_listeners(start_listeners(url, 1))
            idle = idle_cost(server.pid, url, args.clients, args.idle_seconds)
            for side, x in idle.items():
                print(f"idle, {side:5s}: API process {100 * x['api']:.2f}% of a core, engine core "
                      f"{100 * x['engine']:.2f}%" + (f", {x['events_per_s']:.2f} events/s per listener"
                                                     if side == "open" else ""), flush=True)
            order = []
            for r in range(args.rounds):
                order += ["none", "open"] if r % 2 == 0 else ["open", "none"]
            for i, side in enumerate(order):
                listeners = start_listeners(url, args.clients) if side == "open" else None
                before = cpu_seconds(server.pid)
                result = bench(url, args, args.seed + i, args.num_prompts, os.path.join(tmp, f"run{i}.json"))
                spent = cpu_seconds(server.pid) - before
                if listeners is not None:
                    listened.append(stop_listeners(listeners))
                runs[side].append(result["output_throughput"])
                cpu_per_token[side].append(spent / max(1, result["total_output_tokens"]))
                extra = ""
                if listeners is not None:
                    got = listened[-1]
                    extra = f", {got['events'] / got['seconds'] / args.clients:.2f} events/s per listener"
                print(f"run {i:2d} {side:5s} output {result['output_throughput']:8.1f} tok/s, {result['completed']} "
                      f"requests in {result['duration']:.1f} s, server CPU {spent:.1f} s{extra}", flush=True)
        finally:
            served.stop()
    mean = {side: sum(v) / len(v) for side, v in runs.items()}
    ratio = mean["open"] / mean["none"]
    pair_ratios = [o / n for n, o in zip(runs["none"], runs["open"])]
    # the runs' own spread: how far apart two runs of the same side are
    spread = max((max(v) - min(v)) / (sum(v) / len(v)) for v in runs.values())
    cpu = {side: 1e3 * sum(v) / len(v) for side, v in cpu_per_token.items()}
    events = sum(x["events"] for x in listened) / max(1e-9, sum(x["seconds"] for x in listened)) / args.clients
    event_bytes = sum(x["bytes"] for x in listened) / max(1, sum(x["events"] for x in listened))
    width = 64
    print("{s:{c}^{n}}".format(s=f" {args.clients} dashboards open vs none ", n=width, c="="))
    print(f"{'Prompts / concurrency / in / out:':<40} {args.num_prompts} / {args.concurrency} / "
          f"{args.input_len} / {args.output_len}")
    print(f"{'No dashboard, output (tok/s):':<40} {mean['none']:.1f}  {[round(x, 1) for x in runs['none']]}")
    print(f"{'Dashboards open, output (tok/s):':<40} {mean['open']:.1f}  {[round(x, 1) for x in runs['open']]}")
    within = abs(1 - ratio) <= max(spread, 0.02)
    print(f"{'Open / none:':<40} {ratio:.3f}  (per round {[round(x, 3) for x in pair_ratios]}; runs' own spread "
          f"{spread:.1%}: {'within noise' if within else 'OUTSIDE noise'})")
    print(f"{'Server CPU ms per output token:':<40} none {cpu['none']:.2f}, open {cpu['open']:.2f}")
    print(f"{'Events per listener per second:':<40} {events:.2f} ({event_bytes:.0f} bytes each)")
    print(f"{'Idle, CPU % of a core (API / engine):':<40} none {100 * idle['none']['api']:.2f} / "
          f"{100 * idle['none']['engine']:.2f}, open {100 * idle['open']['api']:.2f} / {100 * idle['open']['engine']:.2f}")
    print("=" * width)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"runs": runs, "ratio": ratio, "pair_ratios": pair_ratios, "spread": spread,
                       "cpu_ms_per_token": cpu, "events_per_listener_s": events, "event_bytes": event_bytes,
                       "idle": idle,
                       "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
