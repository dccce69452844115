"""The GPU paths that sat behind switches (issue 25), each measured against the path it replaced, in one run.

Of the seven switches, three remain as A/B switches for paths that won (`=0` selects the old path):
PAGEDLLM_QUANT_TILED, PAGEDLLM_KV_SCALES, PAGEDLLM_PARTIAL_BLOCK_COPIES; the four that lost were deleted with their
code (docs/benchmarks.md, "The seven GPU switches"). This driver runs each A/B as its own benchmark command, in a
fixed order with a timeout per step, and appends every command's output to one log and its key lines to a summary
(both under --out), so a run cut short by the device limit still returns what it measured.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_switches.py --out $OUT [--only quant_e2e kv_scales ...] [--list]

Steps (name: what, A/B):
  quant_layers    8B layer shapes at 1..256 rows: int4 tiled (default) vs int4-old (the general dequant kernel),
                  bf16 beside them (benchmarks/quant.py)
  quant_e2e       8B GPTQ int4 g128, batch-1 decode ms/token, tiled vs PAGEDLLM_QUANT_TILED=0 (latency.py)
  kv_scales       Qwen3-0.6B nano protocol with --kv-cache-dtype fp8: calibrated scales (default) vs
                  PAGEDLLM_KV_SCALES=0, as A B A after an untimed warm-up run (the first run of a machine compiles)
  beam            Qwen3-0.6B beam search, width 4: partial-block copies (default) vs PAGEDLLM_PARTIAL_BLOCK_COPIES=0
  verify          8B, batch 1: a k=4 verify step vs a plain decode step on the default path (spec_decode.py verify)
  chain           32 decoder layers of the 8B shape at 1/5/8/16 rows: the Triton GEMV vs cuBLAS (gemv.py)
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


def lat(model, dtype="bfloat16"):
    return [PY, f"{B}/latency.py", "--model", f"{CFG}/{model}", "--load-format", "dummy", "--dtype", dtype,
            "--batch-size", "1", "--input-len", "128", "--output-len", "256", "--hf", "none", "--iters", "3"]


def nano(extra=(), prompts="256"):
    return [PY, f"{B}/offline_throughput.py", "--model", f"{CFG}/qwen3-0.6b", "--load-format", "dummy",
            "--dtype", "bfloat16", "--num-prompts", prompts, "--input-len", "100", "1024", "--output-len", "100",
            "1024", "--max-model-len", "2048", "--temperature", "0.6", "--hf", "none", "--no-tqdm", *extra]


# Batch-1 steps: the one prefill runs eagerly instead of capturing every mixed-step bucket first (start-up time).
NO_MIXED = {"PAGEDLLM_MIXED_GRAPH_MAX_TOKENS": "0"}
FP8 = ["--kv-cache-dtype", "fp8"]
VERIFY = [PY, f"{B}/spec_decode.py", "verify", "--model", f"{CFG}/llama3-8b", "--load-format", "dummy", "--dtype",
          "bfloat16", "--steps", "60", "--iters", "3", "--profile"]

# (step, label, env, argv, timeout s)
STEPS = [
    ("quant_layers", "tiled vs old, per layer", {}, [PY, f"{B}/quant.py", "--model", "8b", "--rows", "1", "2", "4",
                                                     "16", "64", "256", "--kinds", "bf16", "int4", "int4-old",
                                                     "int8"], 240),
    ("quant_e2e", "tiled", NO_MIXED, lat("llama3-8b-gptq-int4"), 150),
    ("quant_e2e", "old (PAGEDLLM_QUANT_TILED=0)", {**NO_MIXED, "PAGEDLLM_QUANT_TILED": "0"},
     lat("llama3-8b-gptq-int4"), 150),
    ("kv_scales", "warm-up (untimed)", {}, nano(FP8, prompts="32"), 150),
    ("kv_scales", "A: calibrated scales (default)", {}, nano(FP8), 150),
    ("kv_scales", "B: scales 1.0 (PAGEDLLM_KV_SCALES=0)", {"PAGEDLLM_KV_SCALES": "0"}, nano(FP8), 150),
    ("kv_scales", "A again", {}, nano(FP8), 150),
    ("beam", "copies vs recompute", {}, [PY, f"{B}/beam_search.py", "--model", f"{CFG}/qwen3-0.6b", "--load-format",
                                         "dummy", "--dtype", "bfloat16", "--beam-width", "4", "--max-tokens", "64",
                                         "--num-prompts", "8"], 150),
    ("verify", "default path", {"PAGEDLLM_MIXED_GRAPH_MAX_TOKENS": "64"}, VERIFY, 180),
    ("chain", "GEMV vs cuBLAS", {}, [PY, f"{B}/gemv.py", "--chain-only", "--shapes", "llama3-8b", "--rows", "1", "5",
                                     "8", "16"], 150),
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
