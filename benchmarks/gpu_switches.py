"""Each GPU path that sat behind a switch, measured against the path it replaced, in one run (issue 25).

The seven switches (src/pagedllm/envs.py) now default to the new path; `=0` (or 0 rows) selects the old one. This
driver runs each A/B as its own benchmark command, in a fixed order with a timeout per step, and appends every
command's output to one log and its key lines to a summary (both under --out), so a run cut short by the device
limit still returns what it measured.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_switches.py --out $OUT [--only quant verify ...] [--list]

Steps (name: what, A/B):
  quant_layers    8B layer shapes at 1..256 rows: int4 tiled (PAGEDLLM_QUANT_TILED, default) vs int4-old (the
                  general dequant kernel), bf16 beside them (benchmarks/quant.py)
  quant_e2e       8B GPTQ int4 g128, batch-1 decode ms/token, tiled vs PAGEDLLM_QUANT_TILED=0 (latency.py)
  verify          8B, batch 1: a k=4 verify step vs a plain decode step, new path (verify graphs + multi-query
                  decode attention + skinny GEMM) vs all three off (spec_decode.py verify)
  verify_parts    the same with one of the three off at a time
  skinny          32 decoder layers of the 8B shape at 1/5/8/16 rows: few-row kernels vs cuBLAS (gemv.py)
  stage_sampling  Qwen3-0.6B, 256 prompts, temperature 0.6: PAGEDLLM_STAGE_SAMPLING default vs =0
  kv_scales       the same with --kv-cache-dtype fp8: calibrated scales (default) vs PAGEDLLM_KV_SCALES=0
  beam            Qwen3-0.6B beam search, width 4: partial-block copies (default) vs PAGEDLLM_PARTIAL_BLOCK_COPIES=0
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

B = os.path.dirname(os.path.abspath(__file__))
CFG = os.path.join(B, "configs")
PY = sys.executable
OFF_VERIFY = {"PAGEDLLM_VERIFY_ATTENTION": "0", "PAGEDLLM_SKINNY_GEMM_MAX_ROWS": "0",
              "PAGEDLLM_VERIFY_GRAPH_MAX_REQS": "0"}
# Batch-1 steps: the one prefill runs eagerly instead of capturing every mixed-step bucket first (start-up time).
NO_MIXED = {"PAGEDLLM_MIXED_GRAPH_MAX_TOKENS": "0"}


def lat(model, dtype="bfloat16"):
    return [PY, f"{B}/latency.py", "--model", f"{CFG}/{model}", "--load-format", "dummy", "--dtype", dtype,
            "--batch-size", "1", "--input-len", "128", "--output-len", "256", "--hf", "none", "--iters", "3"]


def verify(extra=()):
    return [PY, f"{B}/spec_decode.py", "verify", "--model", f"{CFG}/llama3-8b", "--load-format", "dummy",
            "--dtype", "bfloat16", "--steps", "60", "--iters", "3", "--profile", *extra]


def nano(extra=()):
    return [PY, f"{B}/offline_throughput.py", "--model", f"{CFG}/qwen3-0.6b", "--load-format", "dummy",
            "--dtype", "bfloat16", "--num-prompts", "256", "--input-len", "100", "1024", "--output-len", "100",
            "1024", "--max-model-len", "2048", "--temperature", "0.6", "--hf", "none", "--no-tqdm", *extra]


# (step, label, env, argv, timeout s)
STEPS = [
    ("quant_layers", "tiled vs old, per layer", {}, [PY, f"{B}/quant.py", "--model", "8b", "--rows", "1", "2", "4",
                                                     "16", "64", "256", "--kinds", "bf16", "int4", "int4-old",
                                                     "int8"], 240),
    ("quant_e2e", "tiled", NO_MIXED, lat("llama3-8b-gptq-int4"), 150),
    ("quant_e2e", "old (PAGEDLLM_QUANT_TILED=0)", {**NO_MIXED, "PAGEDLLM_QUANT_TILED": "0"},
     lat("llama3-8b-gptq-int4"), 150),
    ("verify", "new path", NO_MIXED, verify(), 180),
    ("verify", "old path (all three off)", {**NO_MIXED, **OFF_VERIFY}, verify(), 180),
    ("skinny", "chain", {}, [PY, f"{B}/gemv.py", "--chain-only", "--shapes", "llama3-8b", "--rows", "1", "5", "8",
                             "16"], 150),
    ("stage_sampling", "staged (default)", {}, nano(), 150),
    ("stage_sampling", "copied (PAGEDLLM_STAGE_SAMPLING=0)", {"PAGEDLLM_STAGE_SAMPLING": "0"}, nano(), 150),
    ("kv_scales", "fp8 KV, calibrated scales (default)", {}, nano(["--kv-cache-dtype", "fp8"]), 150),
    ("kv_scales", "fp8 KV, scales 1.0 (PAGEDLLM_KV_SCALES=0)", {"PAGEDLLM_KV_SCALES": "0"},
     nano(["--kv-cache-dtype", "fp8"]), 150),
    ("beam", "copies vs recompute", {}, [PY, f"{B}/beam_search.py", "--model", f"{CFG}/qwen3-0.6b", "--load-format",
                                         "dummy", "--dtype", "bfloat16", "--beam-width", "4", "--max-tokens", "64",
                                         "--num-prompts", "8"], 150),
    ("verify_parts", "attention off", {**NO_MIXED, "PAGEDLLM_VERIFY_ATTENTION": "0"}, verify(), 180),
    ("verify_parts", "skinny GEMM off", {**NO_MIXED, "PAGEDLLM_SKINNY_GEMM_MAX_ROWS": "0"}, verify(), 180),
    ("verify_parts", "verify graphs off", {**NO_MIXED, "PAGEDLLM_VERIFY_GRAPH_MAX_REQS": "0"}, verify(), 180),
]
# Lines worth keeping in the summary: results, ratios, failures.
KEY = re.compile(r"(ratio|tok/s|ms/token|median|Throughput|throughput|x bf16|us |GB/s|Error|error|Traceback|"
                 r"FAILED|same beams|device time|\[verify|\[beam|^\s*(qkv|o|gate_up|down|sum|total)\b)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--only", nargs="+", help="step names to run")
    p.add_argument("--list", action="store_true")
    p.add_argument("--budget", type=float, default=1e9, help="stop starting steps after this many seconds")
    args = p.parse_args(argv)
    steps = [s for s in STEPS if not args.only or s[0] in args.only]
    if args.list:
        for name, label, env, cmd, timeout in steps:
            print(name, "|", label, "|", " ".join(f"{k}={v}" for k, v in env.items()), " ".join(cmd), f"({timeout} s)")
        return
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "switches.log"), "a")
    summary = open(os.path.join(args.out, "switches_summary.txt"), "a")
    results = []
    t0 = time.time()
    for name, label, env, cmd, timeout in steps:
        if time.time() - t0 > args.budget:
            summary.write(f"== {name} / {label}: not started (budget)\n")
            continue
        head = f"== {name} / {label}: {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd)}"
        print(head, flush=True)
        log.write(head + "\n")
        log.flush()
        start = time.time()
        try:
            r = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, capture_output=True,
                               text=True, timeout=timeout)
            out, rc = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            out += (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc = "timeout"
        secs = time.time() - start
        log.write(out + f"\n-- rc {rc}, {secs:.0f} s\n")
        log.flush()
        keep = [line for line in out.splitlines() if KEY.search(line) and "Warning" not in line][-40:]
        summary.write(head + f"\n   rc {rc}, {secs:.0f} s\n" + "".join(f"   {line}\n" for line in keep))
        summary.flush()
        print(f"   rc {rc}, {secs:.0f} s", flush=True)
        results.append(dict(step=name, label=label, env=env, rc=rc, seconds=round(secs, 1), lines=keep))
    with open(os.path.join(args.out, "switches.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
