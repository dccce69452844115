"""The served workload of issue 26 on one machine, side by side: `pagedllm serve`, the same requests offline
(`pagedllm.LLM`), and real vLLM's `vllm serve`, all driven by the same `pagedllm bench serve` client.

    python benchmarks/serve_vs_vllm.py --model DIR --load-format dummy --dtype bfloat16 \\
        --workload 1024x256 --workload 4096x1024 --vllm-python "env PYTHONPATH=/tmp/vsite python3" --out OUTDIR

DIR holds a config.json and a tokenizer (benchmarks/configs/qwen3-0.6b beside SmolLM2's tokenizer files on the
GPU: `--tokenizer-from TOKDIR` copies them in). A workload NxC is N random-token prompts at concurrency C, input and
output lengths uniform in 88 x (1 -+ 0.818) (16..160), ignore_eos, greedy; every server and the offline engine run
with --max-num-seqs C. For each server kind (--servers: `pagedllm` with the server's default API process count,
`pagedllm:N` with --api-server-count N, `vllm`) and each workload: start the server, warm it up, run the workload,
stop it; record the client's result, the CPU each server process spent per second (API processes, engine core) and
whether the client kept up. `--offline` adds the offline engine on the same prompts (a fresh process per workload).
Results: OUTDIR/results.json and a table on stdout. Every step has its own timeout; a failed step is recorded and
the run goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _server import PAGEDLLM, QUIET, bench_serve_cmd  # noqa: E402

MEAN_LEN = 88
RANGE_RATIO = 0.818


def parse_workload(text: str) -> tuple[int, int]:
    try:
        n, c = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a workload is PROMPTSxCONCURRENCY, e.g. 1024x256, not {text!r}") from None
    if n < 1 or c < 1:
        raise argparse.ArgumentTypeError(f"prompts and concurrency must be >= 1: {text!r}")
    return n, c


def bench_cmd(url: str, n: int, c: int, seed: int, result: str) -> list[str]:
    return bench_serve_cmd(url, n, c, MEAN_LEN, MEAN_LEN, seed, result,
                           extra=["--random-range-ratio", str(RANGE_RATIO)])


def tree_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{pid: (role, CPU seconds)} of a process and all its descendants (psutil)."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = (role_of(p, pid), t.user + t.system)
        except psutil.Error:
            pass
    return out


def role_of(p: Any, root_pid: int) -> str:
    """What a server process is, from its name (pagedllm names its processes pagedllm-core-N / pagedllm-api-N,
    vLLM its engine VLLM::EngineCore): engine, api, supervisor (the parent of several API processes) or other."""
    try:
        name = p.name().lower()
        if "core" in name:
            return "engine"
        if name.startswith("pagedllm-api") or ("worker" not in name and p.pid == root_pid):
            if p.pid == root_pid and any(c.name().startswith("pagedllm-api") for c in p.children()):
                return "supervisor"
            return "api"
    except Exception:  # noqa: BLE001 - gone meanwhile
        pass
    return "other"


def cpu_by_role(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds spent per role between two tree_cpu snapshots (processes present at the end; ones that started
    meanwhile count from zero)."""
    roles: dict[str, float] = {}
    for pid, (role, t) in after.items():
        t0 = before.get(pid, (role, 0.0))[1]
        roles[role] = roles.get(role, 0.0) + (t - t0)
    return {k: round(v, 3) for k, v in roles.items()}


def start(cmd: list[str], log_path: str, env: Optional[dict], timeout_s: float) -> tuple[subprocess.Popen, str]:
    from pagedllm.entrypoints.server_process import free_port, wait_healthy

    port = free_port()
    cmd = [*cmd, "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout_s=timeout_s, log_path=log_path)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen, wait_s: float = 60) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            return
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    # stray children (engine cores, vLLM's workers) of a server that died hard
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kv_flags(args: argparse.Namespace) -> list[str]:
    """pagedllm's KV pool: sized from --gpu-memory-utilization unless --kv-cache-memory-bytes is given (the CPU)."""
    return ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)] if args.kv_cache_memory_bytes else []


def server_cmd(kind: str, args: argparse.Namespace, c: int) -> tuple[list[str], Optional[dict]]:
    common = ["--load-format", args.load_format, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", str(c), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
              "--seed", "0"]
    if kind == "vllm":
        if not args.vllm_python:
            raise RuntimeError("--vllm-python is needed for the vllm server")
        py = shlex.split(args.vllm_python)
        return [*py, "-m", "vllm.entrypoints.cli.main", "serve", args.model, *common,
                "--uvicorn-log-level", "warning"], None
    flags = [*PAGEDLLM, "serve", args.model, *QUIET, *common, *kv_flags(args)]
    if ":" in kind:
        flags += ["--api-server-count", kind.split(":", 1)[1]]
    return flags, None


def run_server(kind: str, args: argparse.Namespace, n: int, c: int, seed: int, out: str) -> dict:
    cmd, env = server_cmd(kind, args, c)
    tag = f"{kind.replace(':', '-api')}-{n}x{c}"
    log_path = os.path.join(out, f"{tag}.log")
    record: dict[str, Any] = {"server": kind, "prompts": n, "concurrency": c, "command": " ".join(cmd)}
    t0 = time.monotonic()
    try:
        proc, url = start(cmd, log_path, env, args.start_timeout)
    except Exception as e:  # noqa: BLE001 - recorded; the run goes on
        record["error"] = f"start: {e}"[:2000]
        return record
    record["start_s"] = round(time.monotonic() - t0, 1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            warm = os.path.join(tmp, "warm.json")
            subprocess.run(bench_cmd(url, min(2 * c, 256), min(c, 128), seed + 1000, warm), check=True,
                           stdout=subprocess.DEVNULL, timeout=args.step_timeout)
            result = os.path.join(out, f"{tag}.json")
            before = tree_cpu(proc.pid)
            done = subprocess.run(bench_cmd(url, n, c, seed, result), capture_output=True, text=True,
                                  timeout=args.step_timeout)
            # CPU seconds over the client's whole life (its start-up too: the server idles then) per second of
            # the measured run
            record["server_cpu_s"] = cpu_by_role(before, tree_cpu(proc.pid))
            print(done.stdout, flush=True)
            if done.returncode != 0:
                record["error"] = f"bench exit {done.returncode}: {done.stderr[-1500:]}"
            if os.path.exists(result):
                with open(result) as f:
                    record["result"] = json.load(f)
                seconds = record["result"]["duration"]
                record["server_cpu_cores"] = {k: round(v / seconds, 2) for k, v in record["server_cpu_s"].items()}
    except Exception as e:  # noqa: BLE001
        record["error"] = f"bench: {e}"[:2000]
    finally:
        stop(proc)
    return record


def run_offline_child(args: argparse.Namespace) -> None:
    """(--offline-child) the offline engine on the workload's prompts; its result as JSON on the last line."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.cli.bench_serve import sample_random_requests, vocab_token_pool

    n, c = args.offline_child
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=c, gpu_memory_utilization=args.gpu_memory_utilization, seed=0,
              **({"kv_cache_memory_bytes": args.kv_cache_memory_bytes} if args.kv_cache_memory_bytes else {}))
    pool = vocab_token_pool(llm.get_tokenizer())

    def go(reqs: list) -> list:
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in reqs]
        return llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)

    go(sample_random_requests(pool, min(2 * c, 256), MEAN_LEN, MEAN_LEN, RANGE_RATIO, args.seed + 1000))
    reqs = sample_random_requests(pool, n, MEAN_LEN, MEAN_LEN, RANGE_RATIO, args.seed)
    t0 = time.perf_counter()
    outs = go(reqs)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"duration": elapsed, "total_output_tokens": tokens, "output_throughput": tokens / elapsed}))


def run_offline(args: argparse.Namespace, n: int, c: int, out: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--load-format", args.load_format,
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization",
           str(args.gpu_memory_utilization), "--seed", str(args.seed), "--offline-child", f"{n}x{c}",
           *(["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)] if args.kv_cache_memory_bytes else [])]
    record: dict[str, Any] = {"server": "offline", "prompts": n, "concurrency": c}
    log_path = os.path.join(out, f"offline-{n}x{c}.log")
    try:
        with open(log_path, "w") as log:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=args.step_timeout
                                  + args.start_timeout)
        lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
        if done.returncode != 0 or not lines:
            record["error"] = f"offline exit {done.returncode}"
        else:
            record["result"] = json.loads(lines[-1])
    except Exception as e:  # noqa: BLE001
        record["error"] = f"offline: {e}"[:2000]
    return record


def table(records: list[dict]) -> str:
    head = ("server", "NxC", "out tok/s", "vs offline", "TTFT mean", "TTFT P99", "TPOT med", "ITL med", "ITL P99",
            "tok/chunk P99", "failed", "client", "server CPU cores")
    offline = {(r["prompts"], r["concurrency"]): r["result"]["output_throughput"]
               for r in records if r["server"] == "offline" and "result" in r}
    rows = [head]
    for r in records:
        res = r.get("result")
        if res is None:
            rows.append((r["server"], f"{r['prompts']}x{r['concurrency']}", "error: " + r.get("error", "?")[:60],
                         *[""] * (len(head) - 3)))
            continue
        off = offline.get((r["prompts"], r["concurrency"]))
        tput = res["output_throughput"]
        if r["server"] == "offline":
            rows.append(("offline", f"{r['prompts']}x{r['concurrency']}", f"{tput:,.0f}", "1.000",
                         *[""] * (len(head) - 4)))
            continue
        rows.append((r["server"], f"{r['prompts']}x{r['concurrency']}", f"{tput:,.0f}",
                     f"{tput / off:.3f}" if off else "-", f"{res['mean_ttft_ms']:.0f}", f"{res['p99_ttft_ms']:.0f}",
                     f"{res['median_tpot_ms']:.2f}", f"{res['median_itl_ms']:.2f}", f"{res['p99_itl_ms']:.1f}",
                     f"{res.get('p99_tokens_per_chunk', 0):.1f}", str(res.get("failed", 0)),
                     f"{res.get('client_processes', '?')} @ {res.get('client_busiest_cpu', 0) * 100:.0f}%",
                     " ".join(f"{k} {v:.2f}" for k, v in sorted(r.get("server_cpu_cores", {}).items()))))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(str(cell).rjust(w) for cell, w in zip(row, widths)) for row in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer-from", default=None,
                   help="copy the tokenizer files of this directory into --model first (a config-only model dir)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="pagedllm's KV pool in bytes (the CPU needs one; default: from --gpu-memory-utilization)")
    p.add_argument("--workload", type=parse_workload, action="append", default=None)
    p.add_argument("--servers", default="pagedllm,vllm",
                   help="comma-separated: pagedllm, pagedllm:N (--api-server-count N), vllm")
    p.add_argument("--offline", action="store_true", help="also the offline engine on the same prompts")
    p.add_argument("--vllm-python", default=None, help='how to run vLLM\'s Python, e.g. "env PYTHONPATH=/tmp/vsite '
                                                      'python3"')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=420)
    p.add_argument("--step-timeout", type=float, default=240)
    p.add_argument("--out", default=".")
    p.add_argument("--offline-child", type=parse_workload, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.offline_child:
        run_offline_child(args)
        return
    workloads = args.workload or [(1024, 256)]
    if args.tokenizer_from:
        for name in os.listdir(args.tokenizer_from):
            if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
                shutil.copy(os.path.join(args.tokenizer_from, name), args.model)
    os.makedirs(args.out, exist_ok=True)
    records = []
    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    for n, c in workloads:
        if args.offline:
            records.append(run_offline(args, n, c, args.out))
            print(json.dumps(records[-1])[:400], flush=True)
        for kind in kinds:
            if kind.startswith("pagedllm:") and (n, c) != workloads[0]:
                continue  # the API-process comparison at the first workload only
            records.append(run_server(kind, args, n, c, args.seed, args.out))
            print(json.dumps({k: v for k, v in records[-1].items() if k != "result"})[:1500], flush=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(records, f, indent=1)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(records, f, indent=1)
    print(table(records), flush=True)


if __name__ == "__main__":
    main()
