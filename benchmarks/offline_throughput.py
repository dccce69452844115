"""Offline throughput: pagedllm vs Hugging Face transformers on the same random prompts, same run.

Default protocol (CPU, SmolLM2-135M): 32 prompts, input lengths uniform in 16..160, output lengths uniform in
16..160, seed 0, ignore_eos. HF runs them as one left-padded batch to the longest output (`generate`), or with
its continuous batching (`generate_batch`, GPU). Both are credited only the tokens each request asked for.

    python benchmarks/offline_throughput.py                       # CPU default
    python benchmarks/offline_throughput.py --model cfgdir --load-format dummy --num-prompts 256 \
        --input-len 100 1024 --output-len 100 1024 --hf none      # GPU shape runs
    python benchmarks/offline_throughput.py ... --engine vllm    # the same requests on real vLLM (GPU peer)
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time

import torch


def make_requests(num_prompts, input_range, output_range, vocab_size, seed, special_ids=()):
    rng = random.Random(seed)
    special = set(special_ids)
    reqs = []
    for _ in range(num_prompts):
        n_in = rng.randint(*input_range)
        n_out = rng.randint(*output_range)
        ids = []
        while len(ids) < n_in:
            t = rng.randrange(vocab_size)
            if t not in special:
                ids.append(t)
        reqs.append((ids, n_out))
    return reqs


HBM_BYTES_PER_S = 4.3e12  # measured H200 copy bandwidth (DEVELOPERS.md)
BF16_FLOP_PER_S = 750e12  # measured H200 bf16 matmul rate


def hardware_bound_s(reqs, num_params, weight_bytes, kv_bytes_per_token, max_num_seqs):
    """A lower bound on device time: prefill FLOPs at the matmul rate, plus every decode step reading the
    weights once and every request reading its whole KV context at each of its decode steps."""
    prefill_flops = 2 * num_params * sum(len(ids) for ids, _ in reqs)
    waves = -(-len(reqs) // max_num_seqs)
    decode_steps = waves * max(n for _, n in reqs)
    kv_bytes = sum(kv_bytes_per_token * (len(ids) * n + n * (n - 1) / 2) for ids, n in reqs)
    return prefill_flops / BF16_FLOP_PER_S + (decode_steps * weight_bytes + kv_bytes) / HBM_BYTES_PER_S


def log_triton_compiles(t0: float) -> None:
    """Print a line whenever Triton compiles (or loads from its disk cache) a kernel variant, with the time
    since t0: compilation inside a timed run shows up as lines after "timed run starts"."""
    try:
        import triton
        from triton.runtime.jit import JITFunction
    except Exception:
        return

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(getattr(fn, "fn", None), "__name__", None) or getattr(fn, "name", None) or "?"
        print(f"[triton] +{time.perf_counter() - t0:.2f}s compile/load {name}: {str(kwargs.get('repr', ''))[:160]}",
              flush=True)
        return False  # never skip the compilation

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(getattr(knobs, "runtime", None), "jit_cache_hook"):
        knobs.runtime.jit_cache_hook = hook
    else:
        JITFunction.cache_hook = hook


def run_pagedllm(args, reqs):
    from pagedllm import LLM, SamplingParams

    kwargs = dict(model=args.model, dtype=args.dtype, load_format=args.load_format, seed=args.seed,
                  max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
                  skip_tokenizer_init=True, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.gpu_memory_utilization:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    t0 = time.perf_counter()
    if args.log_compiles:
        log_triton_compiles(t0)
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    if args.device_sampling != "auto":  # A/B of the one-kernel CUDA sampler (the engine runs in this process)
        from pagedllm.layers import sampler as sampler_mod

        sampler_mod.DEVICE_SAMPLING = args.device_sampling == "on"
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    params = [SamplingParams(**sampling, max_tokens=n, ignore_eos=True, seed=None) for _, n in reqs]
    # Warm-up (not timed): a couple of tiny requests, sampled as the run samples (the sampler's kernels compile).
    llm.generate(prompts[:2], [SamplingParams(**sampling, max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)
    if not llm.engine.reset_prefix_cache():  # the timed run must get no prefix-cache hits from the warm-up
        print("warning: the prefix cache could not be reset after the warm-up", file=sys.stderr)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if args.log_compiles:
        print("[triton] timed run starts", flush=True)
    outs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(n for _, n in reqs), "pagedllm produced a different number of tokens than asked"
    model_dir = llm.engine.model_dir
    model = llm.engine.worker.model
    bound = None
    if torch.cuda.is_available():
        bound = hardware_bound_s(reqs, sum(p.numel() for p in model.parameters()),
                                 sum(p.numel() * p.element_size() for p in model.parameters()),
                                 llm.engine.worker.runner.kv_cache_spec().bytes_per_token, args.max_num_seqs)
    del model
    llm.shutdown()
    return {"elapsed_s": elapsed, "output_tokens": n_out, "startup_s": startup, "model_dir": model_dir,
            "hardware_bound_s": bound}


def run_vllm(args, reqs):
    """The same requests on real vLLM's offline API (where it is importable: the GPU machine with the wheel that
    ../shared/device/vllm-peer.sh brings), credited the same tokens. Run it in its own process (--engine vllm)."""
    import vllm

    if not hasattr(vllm, "EngineArgs") or "pagedllm" in getattr(vllm, "__file__", ""):
        raise SystemExit("--engine vllm needs the real vLLM; the pagedllm-vllm-compat shim is what imports as vllm "
                         "here (uninstall it, or put the real vLLM first on PYTHONPATH).")
    kwargs = dict(model=args.model, dtype=args.dtype, load_format=args.load_format, seed=args.seed,
                  max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager, skip_tokenizer_init=True)
    for name in ("max_model_len", "max_num_batched_tokens", "gpu_memory_utilization"):
        if getattr(args, name):
            kwargs[name] = getattr(args, name)
    t0 = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    startup = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [vllm.SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=n,
                                  ignore_eos=True, detokenize=False) for _, n in reqs]
    llm.generate(prompts[:2], [vllm.SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False)] * 2,
                 use_tqdm=False)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "startup_s": startup, "version": vllm.__version__}


def run_hf(args, reqs, model_dir):
    from transformers import AutoModelForCausalLM

    dtype = {"auto": torch.float32 if not torch.cuda.is_available() else torch.bfloat16, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.load_format == "dummy":
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).to(device)
    model.eval()
    hf_reqs = reqs[: args.hf_num_prompts] if args.hf_num_prompts else reqs
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    if args.hf == "generate":
        max_in = max(len(ids) for ids, _ in hf_reqs)
        max_out = max(n for _, n in hf_reqs)
        input_ids = torch.full((len(hf_reqs), max_in), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, (ids, _) in enumerate(hf_reqs):
            input_ids[i, max_in - len(ids):] = torch.tensor(ids)
            mask[i, max_in - len(ids):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        with torch.inference_mode():
            model.generate(input_ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4, min_new_tokens=4,
                           do_sample=False, pad_token_id=pad)  # warm-up
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(input_ids, attention_mask=mask, max_new_tokens=max_out, min_new_tokens=max_out,
                           do_sample=False, pad_token_id=pad)
            if device == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
    else:  # continuous batching in transformers
        from transformers import GenerationConfig

        gen_cfg = GenerationConfig(max_new_tokens=max(n for _, n in hf_reqs), do_sample=False, eos_token_id=None,
                                   pad_token_id=pad)
        with torch.no_grad():  # generate_batch updates its own tensors in place: no inference_mode here
            t0 = time.perf_counter()
            results = model.generate_batch(inputs=[ids for ids, _ in hf_reqs], generation_config=gen_cfg)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
        produced = sum(len(getattr(r, "generated_tokens", []) or []) for r in
                       (results.values() if isinstance(results, dict) else results))
        if produced < sum(n for _, n in hf_reqs):
            raise RuntimeError(f"HF generate_batch produced only {produced} tokens; its timing is not valid.")
    credited = sum(n for _, n in hf_reqs)
    return {"elapsed_s": elapsed, "output_tokens": credited, "num_prompts": len(hf_reqs)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 160], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 160], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: none (pagedllm's and vLLM's 'off' alike)")
    p.add_argument("--device-sampling", choices=["auto", "on", "off"], default="auto",
                   help="on CUDA, the one-kernel sampler (kernels/sampling.py: the default) or the general path")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", default=None, help="e.g. fp8 (online W8A8); quantized checkpoints are detected")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--hf", choices=["generate", "generate_batch", "none"], default="generate")
    p.add_argument("--hf-num-prompts", type=int, default=None, help="run HF on the first N prompts only")
    p.add_argument("--no-tqdm", action="store_true")
    p.add_argument("--log-compiles", action="store_true", help="print each Triton kernel compilation (GPU)")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--engine", choices=["pagedllm", "vllm"], default="pagedllm",
                   help="vllm: the same requests on real vLLM (the peer; one engine per process)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from pagedllm.models.loader import load_hf_config, prepare_model_dir, resolve_model_path

    model_dir = prepare_model_dir(resolve_model_path(args.model), args.load_format)
    cfg = load_hf_config(model_dir)
    special = [t for t in (cfg.bos_token_id, cfg.eos_token_id, getattr(cfg, "pad_token_id", None)) if isinstance(t, int)]
    reqs = make_requests(args.num_prompts, args.input_len, args.output_len, min(cfg.vocab_size, 32000) if cfg.vocab_size > 1000 else cfg.vocab_size,
                         args.seed, special)
    if args.engine == "vllm":
        peer = run_vllm(args, reqs)
        tput = peer["output_tokens"] / peer["elapsed_s"]
        print(f"vllm {peer['version']}: {peer['output_tokens']} output tokens in {peer['elapsed_s']:.2f} s = "
              f"{tput:.1f} tok/s (startup {peer['startup_s']:.1f} s)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "vllm": peer}, f, indent=2)
        return peer
    ours = run_pagedllm(args, reqs)
    result = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "date": time.strftime("%Y-%m-%d"), "args": vars(args), "pagedllm": ours}
    tput = ours["output_tokens"] / ours["elapsed_s"]
    print(f"pagedllm: {ours['output_tokens']} output tokens in {ours['elapsed_s']:.2f} s = {tput:.1f} tok/s "
          f"(startup {ours['startup_s']:.1f} s)")
    if ours["hardware_bound_s"]:
        print(f"hardware bound ~{ours['hardware_bound_s']:.2f} s (prefill FLOPs / 750 TFLOP/s + weight and KV "
              f"reads / 4.3 TB/s): pagedllm reaches {ours['hardware_bound_s'] / ours['elapsed_s'] * 100:.0f}% of it")
    if args.hf != "none":
        hf = run_hf(args, reqs, model_dir)
        hf_tput = hf["output_tokens"] / hf["elapsed_s"]
        result["hf"] = hf
        result["ratio"] = tput / hf_tput
        print(f"HF {args.hf}: {hf['output_tokens']} credited tokens ({hf['num_prompts']} prompts) in "
              f"{hf['elapsed_s']:.2f} s = {hf_tput:.1f} tok/s")
        print(f"ratio pagedllm / HF = {tput / hf_tput:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
