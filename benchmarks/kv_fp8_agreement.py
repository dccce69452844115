"""FP8 KV cache accuracy (issue 27): greedy agreement with the model-dtype KV pool, SmolLM2-135M in bf16.

    nice -n 19 python benchmarks/kv_fp8_agreement.py [--peer-python /path/to/vllm-venv/bin/python]

The bundled SmolLM2-135M-Instruct GGUF, loaded by both engines from pagedllm's converted HF directory (float
weights, run in bfloat16); 8 chat-templated prompts, greedy, 64 new tokens, ignore_eos, one batch. pagedllm:
the bf16 pool (default backend and the torch backend the FP8 pool runs on) vs the FP8 (E4M3) pool unscaled
(PAGEDLLM_KV_SCALES=0) and with calibrated scales (=1). With --peer-python, real vLLM in that python: "auto"
vs its FP8 KV cache. Per prompt: tokens equal before the first difference, and the share of equal positions.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPTS = [
    "What is the capital of France, and why is it famous?",
    "Write a haiku about the sea.",
    "Explain how a bicycle stays upright while moving.",
    "Give me three tips for learning a new language.",
    "Describe the water cycle to a ten-year-old.",
    "What are the main differences between cats and dogs as pets?",
    "Write a short story about a robot who learns to paint.",
    "How do I make a simple tomato pasta sauce?",
]

# Child run in the peer's python: argv = model dir, kv_cache_dtype list (JSON), prompts (JSON token ids), n.
_VLLM_CHILD = r'''
import json, sys, time
import vllm
model, kv_dtypes, prompts, n = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
res = {"version": vllm.__version__, "runs": {}}
for kv in kv_dtypes:
    t0 = time.perf_counter()
    try:
        llm = vllm.LLM(model=model, tokenizer=model, dtype="bfloat16", kv_cache_dtype=kv, max_model_len=1024,
                       seed=0, enforce_eager=True)
        sp = vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        res["runs"][kv] = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "s": time.perf_counter() - t0}
        del llm
    except Exception as e:  # record what vLLM says
        res["runs"][kv] = {"error": f"{type(e).__name__}: {e}"}
    import gc; gc.collect()
print("RESULT " + json.dumps(res), flush=True)
'''


def agreement(ref: list[int], other: list[int]) -> tuple[int, float]:
    first = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
    equal = sum(a == b for a, b in zip(ref, other)) / max(len(ref), 1)
    return first, equal


def run_pagedllm(model_dir: str, prompts: list[list[int]], n: int, kv: str, backend, scales) -> list[list[int]]:
    from pagedllm import LLM, SamplingParams

    if scales is not None:
        os.environ["PAGEDLLM_KV_SCALES"] = scales
    else:
        os.environ.pop("PAGEDLLM_KV_SCALES", None)
    llm = LLM(model=model_dir, dtype="bfloat16", kv_cache_dtype=kv, attention_backend=backend, seed=0,
              max_model_len=1024)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm.shutdown()
    os.environ.pop("PAGEDLLM_KV_SCALES", None)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peer-python", default=None, help="python of a venv with vLLM (omit: pagedllm only)")
    p.add_argument("--peer-kv", nargs="+", default=["auto", "fp8"],
                   help="vLLM kv_cache_dtype values, the first is the reference (e.g. auto fp8_e5m2)")
    p.add_argument("--json", default=None, help="write all token ids and results here")
    args = p.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    from pagedllm.models.gguf import convert_gguf_to_hf
    from pagedllm.models.loader import default_model_path

    model_dir = convert_gguf_to_hf(default_model_path())
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for t in PROMPTS]
    print(f"model dir {model_dir}; prompt lengths {[len(x) for x in prompts]}", flush=True)

    # name -> (kv_cache_dtype, attention_backend, PAGEDLLM_KV_SCALES)
    configs = {"bf16 pool": ("auto", None, None), "bf16 pool, torch backend": ("auto", "torch", None),
               "fp8 scale 1": ("fp8", None, "0"), "fp8 calibrated": ("fp8", None, "1")}
    tokens: dict[str, list[list[int]]] = {}
    for name, (kv, backend, scales) in configs.items():
        t0 = time.perf_counter()
        tokens[name] = run_pagedllm(model_dir, prompts, args.max_tokens, kv, backend, scales)
        print(f"[pagedllm] {name}: {time.perf_counter() - t0:.1f} s", flush=True)

    peer = None
    if args.peer_python:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        t0 = time.perf_counter()
        proc = subprocess.run([args.peer_python, "-c", _VLLM_CHILD, model_dir, json.dumps(args.peer_kv),
                               json.dumps(prompts), str(args.max_tokens)], env=env, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"[vllm] failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}", flush=True)
        else:
            peer = json.loads(line[len("RESULT "):])
            print(f"[vllm {peer['version']}] {time.perf_counter() - t0:.1f} s", flush=True)
            for kv, r in peer["runs"].items():
                if "error" in r:
                    print(f"[vllm] kv_cache_dtype={kv}: {r['error']}", flush=True)
                else:
                    tokens[f"vllm {kv}"] = r["tokens"]

    # Comparisons: (column label, reference, other)
    pairs = [("bf16 pool: default vs torch backend", "bf16 pool", "bf16 pool, torch backend"),
             ("fp8 scale 1 vs bf16 pool", "bf16 pool", "fp8 scale 1"),
             ("fp8 calibrated vs bf16 pool", "bf16 pool", "fp8 calibrated")]
    if peer is not None:
        ref = f"vllm {args.peer_kv[0]}"
        pairs.append((f"vllm {args.peer_kv[0]} vs pagedllm bf16 pool", "bf16 pool", ref))
        for kv in args.peer_kv[1:]:
            pairs.append((f"vllm {kv} vs vllm {args.peer_kv[0]}", ref, f"vllm {kv}"))
    pairs = [pr for pr in pairs if pr[1] in tokens and pr[2] in tokens]

    print("\n| prompt | " + " | ".join(label for label, _, _ in pairs) + " |")
    print("|---|" + "---|" * len(pairs))
    totals = [[0, 0.0] for _ in pairs]
    for i, text in enumerate(PROMPTS):
        cells = []
        for j, (_, a, b) in enumerate(pairs):
            first, equal = agreement(tokens[a][i], tokens[b][i])
            totals[j][0] += first
            totals[j][1] += equal
            cells.append(f"{first} / {equal:.0%}")
        print(f"| {i + 1}. {text[:40]} | " + " | ".join(cells) + " |")
    n = len(PROMPTS)
    print("| mean | " + " | ".join(f"{f / n:.1f} / {e / n:.0%}" for f, e in totals) + " |")
    print(f"\ncells: tokens equal before the first difference (of {args.max_tokens}) / share of equal positions")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompts": PROMPTS, "prompt_ids": prompts, "tokens": tokens,
                       "vllm": None if peer is None else {"version": peer["version"],
                                                           "errors": {k: r["error"] for k, r in peer["runs"].items()
                                                                      if "error" in r}}}, f)


if __name__ == "__main__":
    main()
