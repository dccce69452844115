"""Issue 28's rows beside real vLLM: n-gram speculation and LoRA at batch 1, each engine with and without, the same
requests. One engine per process (vLLM starts an engine process of its own and is not made to share one): the
driver runs each (engine, variant) in a child process and prints the table.

    # SmolLM2 (the bundled GGUF, converted once to a Hugging Face directory both engines read), the repeat / edit
    # or code-editing tasks of spec_decode.py, one request at a time, greedy until EOS; tok/s without and with
    # n-gram speculation (k, lookup 2..4)
    python benchmarks/spec_lora_peer.py ngram --model SmolLM2-135M-Instruct.Q4_1.gguf --tasks edit --k 8
    # batch-1 decode with a random rank-16 adapter on all 7 projections vs the base model (dummy 8B weights)
    python benchmarks/spec_lora_peer.py lora --model benchmarks/configs/llama3-8b --rank 16
    # --engines pagedllm vllm (default: both; vllm needs the real vLLM: ../shared/device/vllm-peer.sh, whose
    # install dir --vllm-path, default /tmp/vsite, goes first on the vLLM child's PYTHONPATH only)
    # --vllm-in-process: vLLM's engine core in its child's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0); its
    # 8B start with LoRA stalled at torch.compile in its engine-core process on the lent H100, twice

vLLM runs with its defaults (torch.compile and CUDA graphs), detokenize off, and the EOS ids stop it as they stop
pagedllm (it is given them, since it loads no tokenizer). Each row is the median of --iters rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _prompts(model_dir: str, tasks: str) -> tuple[list[list[int]], list[int]]:
    """(the tasks' chat prompts as token ids, the EOS ids) from the model directory's tokenizer."""
    sys.path.insert(0, HERE)
    from spec_decode import TASK_SETS
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for text in TASK_SETS[tasks]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    eos = set()
    cfg_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            got = json.load(f).get("eos_token_id")
        eos.update(got if isinstance(got, list) else [got] if got is not None else [])
    if tok.eos_token_id is not None:
        eos.add(tok.eos_token_id)
    return prompts, sorted(eos)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Engine:
    """One engine of either kind, generating token-id prompts greedily, one request per call."""

    def __init__(self, kind: str, model: str, load_format: str, max_model_len: int, dtype: str,
                 spec: dict | None = None, lora_rank: int = 0) -> None:
        self.kind = kind
        common = dict(model=model, dtype=dtype, max_model_len=max_model_len, gpu_memory_utilization=0.5,
                      max_num_seqs=8, seed=0, skip_tokenizer_init=True)
        if load_format != "auto":
            common["load_format"] = load_format
        if spec is not None:
            common["speculative_config"] = spec
        if lora_rank:
            common.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank)
        if kind == "vllm":
            import vllm

            if not hasattr(vllm, "EngineArgs") or "pagedllm" in getattr(vllm, "__file__", ""):
                raise SystemExit("--engines vllm needs the real vLLM importable (../shared/device/vllm-peer.sh).")
            self.mod = vllm
            self.llm = vllm.LLM(**common)
        else:
            import pagedllm

            self.mod = pagedllm
            self.llm = pagedllm.LLM(**common)

    def generate(self, ids: list[int], max_tokens: int, stop_ids: list[int], ignore_eos: bool = False,
                 lora=None) -> tuple[float, int]:
        """Wall seconds and output tokens of one request."""
        kw = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        if self.kind == "vllm":
            params = self.mod.SamplingParams(**kw, stop_token_ids=list(stop_ids), detokenize=False)
        else:
            params = self.mod.SamplingParams(**kw, stop_token_ids=list(stop_ids))
        _sync()
        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False, lora_request=lora)
        _sync()
        return time.perf_counter() - t0, len(out[0].outputs[0].token_ids)

    def lora_request(self, path: str):
        if self.kind == "vllm":
            from vllm.lora.request import LoRARequest
        else:
            from pagedllm import LoRARequest
        return LoRARequest("a0", 1, path)


def child_ngram(args) -> dict:
    model_dir = args.model  # (a Hugging Face directory: the driver converted a .gguf)
    prompts, eos = _prompts(model_dir, args.tasks)
    spec = None if args.variant == "plain" else {
        "method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    engine = _Engine(args.engine, model_dir, "auto", args.max_model_len, args.dtype, spec)
    for ids in prompts:  # warm-up: compiles, graphs, the allocator
        engine.generate(ids, args.output_len, eos)
    rounds = []
    for _ in range(args.iters):
        seconds = tokens = 0
        for ids in prompts:
            s, n = engine.generate(ids, args.output_len, eos)
            seconds, tokens = seconds + s, tokens + n
        rounds.append(tokens / seconds)
    return {"tok_s": statistics.median(rounds), "rounds": rounds, "tokens": tokens}


def child_lora(args) -> dict:
    sys.path.insert(0, HERE)
    from lora import write_dummy_adapter
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(args.model)
    adapter = write_dummy_adapter(os.path.join(tempfile.mkdtemp(), "a0"), cfg, args.rank, seed=0)
    engine = _Engine(args.engine, args.model, "dummy", args.input_len + args.output_len + 16, args.dtype,
                     lora_rank=args.rank)
    rng = random.Random(0)
    ids = [rng.randrange(10, min(cfg.vocab_size, 32000)) for _ in range(args.input_len)]
    lora = engine.lora_request(adapter)

    def ms_per_token(with_adapter: bool) -> float:
        # (the whole request's wall minus a one-token request's: the decode steps alone)
        req = lora if with_adapter else None
        full, n = engine.generate(ids, args.output_len, [], ignore_eos=True, lora=req)
        first, _ = engine.generate(ids, 1, [], ignore_eos=True, lora=req)
        return (full - first) / (n - 1) * 1e3

    ms_per_token(False), ms_per_token(True)  # warm-up
    base, tuned = [], []
    for i in range(args.iters):  # alternating, so drift weighs on both
        for with_adapter in ((False, True) if i % 2 == 0 else (True, False)):
            (tuned if with_adapter else base).append(ms_per_token(with_adapter))
    b, t = statistics.median(base), statistics.median(tuned)
    return {"base_ms": b, "lora_ms": t, "ratio": t / b, "base_runs": base, "lora_runs": tuned}


def _run_child(args, engine: str, variant: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), args.mode, "--child", engine, "--variant", variant,
           "--model", args.model, "--iters", str(args.iters), "--dtype", args.dtype]
    if args.mode == "ngram":
        cmd += ["--tasks", args.tasks, "--k", str(args.k), "--output-len", str(args.output_len),
                "--max-model-len", str(args.max_model_len)]
    else:
        cmd += ["--rank", str(args.rank), "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    env = dict(os.environ)
    if engine == "vllm" and args.vllm_path:  # (vLLM's dependencies first for its child only, not for pagedllm's)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.vllm_path, env.get("PYTHONPATH")]))
        env.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "vcache"))
        if args.vllm_in_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    start = time.perf_counter()
    print(f"[{args.mode}] {engine} {variant}: started", flush=True)  # (a call cut off at its limit shows how far)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout, env=env)
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"))[-3000:]
        print(f"[{args.mode}] {engine} {variant} timed out after {args.child_timeout} s:\n{tail}", file=sys.stderr)
        return {"error": "timeout"}
    print(f"[{args.mode}] {engine} {variant}: done in {time.perf_counter() - start:.0f} s", flush=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stdout + proc.stderr)[-3000:]
    print(f"[{args.mode}] {engine} {variant} failed (rc {proc.returncode}):\n{tail}", file=sys.stderr)
    return {"error": proc.returncode}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["ngram", "lora"])
    p.add_argument("--model", required=True)
    p.add_argument("--engines", nargs="+", default=["pagedllm", "vllm"], choices=["pagedllm", "vllm"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tasks", default="edit", choices=["edit", "code"],
                   help="ngram: the repeat / edit tasks or the code set")
    p.add_argument("--k", type=int, default=8, help="ngram: num_speculative_tokens")
    p.add_argument("--rank", type=int, default=16, help="lora: the adapter's rank")
    p.add_argument("--input-len", type=int, default=128, help="lora: prompt tokens")
    p.add_argument("--output-len", type=int, default=256, help="max output tokens (lora: exactly this many)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--child-timeout", type=int, default=900)
    p.add_argument("--vllm-path", default="/tmp/vsite" if os.path.isdir("/tmp/vsite") else None,
                   help="put first on PYTHONPATH for vLLM's child process (where vllm-peer.sh's install went)")
    p.add_argument("--vllm-in-process", action="store_true",
                   help="vLLM's engine core in the child's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.engine = args.child
        result = child_ngram(args) if args.mode == "ngram" else child_lora(args)
        print("RESULT " + json.dumps(result), flush=True)
        return result
    if args.mode == "ngram":  # both engines read the same directory (a .gguf converted once, here)
        from pagedllm.models.loader import prepare_model_dir

        args.model = prepare_model_dir(args.model)
    results: dict = {}
    for engine in args.engines:
        if args.mode == "ngram":
            plain, spec = _run_child(args, engine, "plain"), _run_child(args, engine, "ngram")
            row = {"plain": plain, "ngram": spec}
            if "tok_s" in plain and "tok_s" in spec:
                row["ratio"] = spec["tok_s"] / plain["tok_s"]
                print(f"[ngram k={args.k}, {args.tasks} tasks, batch 1] {engine}: without {plain['tok_s']:.1f} "
                      f"tok/s, with {spec['tok_s']:.1f} tok/s = {row['ratio']:.3f}x", flush=True)
        else:
            row = _run_child(args, engine, "lora")
            if "ratio" in row:
                print(f"[lora rank {args.rank}, batch 1] {engine}: base {row['base_ms']:.3f} ms/token, with the "
                      f"adapter {row['lora_ms']:.3f} = {row['ratio']:.3f}x", flush=True)
        results[engine] = row
        _write_json(args, results)  # after each engine: a call cut off at its limit keeps what finished
    if len(args.engines) == 2 and args.mode == "ngram" and all("ratio" in results[e] for e in args.engines):
        ours, peer = (results[e]["ngram"]["tok_s"] for e in ("pagedllm", "vllm"))
        print(f"[ngram] with speculation, pagedllm / vllm: {ours / peer:.3f}x", flush=True)
    if len(args.engines) == 2 and args.mode == "lora" and all("ratio" in results[e] for e in args.engines):
        ours, peer = (results[e]["lora_ms"] for e in ("pagedllm", "vllm"))
        print(f"[lora] with the adapter, vllm / pagedllm ms per token: {peer / ours:.3f}x", flush=True)
    return results


def _write_json(args, results: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
