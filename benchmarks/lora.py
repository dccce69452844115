"""Multi-LoRA speed: throughput with requests spread over 1 / 4 / 16 adapters vs the base model, and batch-1
decode latency with an adapter vs without. Dummy weights and dummy adapters (random rank-R LoRA on all seven
projections, written in PEFT format), so it needs no checkpoint and no peft.

    # throughput, Qwen3-0.6B shape: 256 requests, in/out U(100..1024); base (engine without LoRA) then 1, 4, 16
    # adapters on one engine with max_loras 16
    python benchmarks/lora.py throughput --model benchmarks/configs/qwen3-0.6b --rank 16
    # batch-1 decode, Llama-3-8B shape, 128 in / 256 out: the same engine, base requests and adapter requests
    python benchmarks/lora.py latency --model benchmarks/configs/llama3-8b --rank 16

Each line prints tok/s (or ms/step) and the ratio to the base model measured in the same process.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_dummy_adapter(path: str, hf_config, rank: int, seed: int) -> str:
    """A PEFT adapter directory with random A and B on every projection of every layer."""
    from safetensors.torch import save_file

    cfg = hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    shapes = {"q_proj": (cfg.hidden_size, cfg.num_attention_heads * head_dim),
              "k_proj": (cfg.hidden_size, kv * head_dim), "v_proj": (cfg.hidden_size, kv * head_dim),
              "o_proj": (cfg.num_attention_heads * head_dim, cfg.hidden_size),
              "gate_proj": (cfg.hidden_size, cfg.intermediate_size), "up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj in PROJECTIONS:
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            n_in, n_out = shapes[proj]
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) / n_in ** 0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.01).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": PROJECTIONS,
                   "bias": "none", "use_rslora": False, "use_dora": False}, f)
    return path


def make_requests(num, input_range, output_range, vocab, seed=0):
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(*input_range))], rng.randint(*output_range))
            for _ in range(num)]


def timed_generate(llm, reqs, lora_requests) -> float:
    from pagedllm import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    # Warm-up (not timed): one short request per adapter (registers it, loads its slot); then an empty prefix cache.
    distinct = list({id(r): r for r in lora_requests}.values())
    llm.generate(prompts[:1] * len(distinct), SamplingParams(max_tokens=4, ignore_eos=True), lora_request=distinct,
                 use_tqdm=False)
    llm.engine.reset_prefix_cache()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=lora_requests, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(n for _, n in reqs)
    return elapsed


def throughput(args, hf_config, adapters) -> dict:
    from pagedllm import LLM, LoRARequest

    reqs = make_requests(args.num_prompts, args.input_len, args.output_len, min(hf_config.vocab_size, 32000))
    total = sum(n for _, n in reqs)
    common = dict(model=args.model, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.input_len[1] + args.output_len[1] + 16)
    results = {}
    llm = LLM(**common)
    base_s = timed_generate(llm, reqs, [None] * len(reqs))
    llm.shutdown()
    results["base"] = {"tok_s": total / base_s}
    print(f"base model (no LoRA engine): {total / base_s:,.0f} tok/s", flush=True)
    llm = LLM(**common, enable_lora=True, max_loras=max(args.num_adapters), max_lora_rank=args.rank)
    lora_reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
    same_engine_base = timed_generate(llm, reqs, [None] * len(reqs))
    print(f"base requests on the LoRA engine: {total / same_engine_base:,.0f} tok/s "
          f"({base_s / same_engine_base:.3f}x base)", flush=True)
    results["base_on_lora_engine"] = {"tok_s": total / same_engine_base, "ratio": base_s / same_engine_base}
    for n in args.num_adapters:
        spread = [lora_reqs[i % n] for i in range(len(reqs))]  # evenly over n adapters
        s = timed_generate(llm, reqs, spread)
        results[f"{n}_adapters"] = {"tok_s": total / s, "ratio": base_s / s}
        print(f"{n:>2} adapters (rank {args.rank}): {total / s:,.0f} tok/s = {base_s / s:.3f}x base", flush=True)
    llm.shutdown()
    return results


def latency(args, adapters) -> dict:
    if args.ab_gemv:  # the few-row path with the expands separate, then in the base GEMVs' epilogues
        return _ab_switch(args, adapters, "GEMV_EXPAND", (("expand-kernels", False), ("gemv-expand", True)))
    if args.ab_fold:  # the few-row path with o_proj's shrink separate, then folded into the attention's reduce
        return _ab_switch(args, adapters, "FOLD_O_SHRINK", (("rows", False), ("fold-o", True)))
    if args.ab:  # the few-row path, then the general kernels at every size
        return _ab_switch(args, adapters, "FUSED_DECODE", (("rows", True), ("separate", False)))
    return latency_one(args, adapters)


def _ab_switch(args, adapters, switch: str, runs) -> dict:
    """Batch-1 latency with lora.layers.<switch> set to each (name, value) of `runs` in turn, an engine each (graphs
    capture the path set at start); the switch is restored after."""
    from pagedllm.lora import layers

    results, default = {}, getattr(layers, switch)
    try:
        for name, value in runs:
            setattr(layers, switch, value)
            print(f"LoRA few-row path {name} (lora.layers.{switch}={value}):", flush=True)
            results[name] = latency_one(args, adapters)
    finally:
        setattr(layers, switch, default)
    return results


def latency_one(args, adapters) -> dict:
    from pagedllm import LLM, LoRARequest, SamplingParams
    from pagedllm.core.engine_core import EngineCoreRequest

    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=8,
              max_model_len=args.latency_input + args.latency_output + 16, enable_lora=True, max_loras=1,
              max_lora_rank=args.rank)
    engine = llm.engine
    lora = LoRARequest("a0", 1, adapters[0])
    engine.add_lora(lora)
    rng = random.Random(0)
    ids = [rng.randrange(10, min(engine.vocab_size, 32000)) for _ in range(args.latency_input)]
    params = SamplingParams(temperature=0.0, max_tokens=args.latency_output, ignore_eos=True)

    def one(tag: str, lora_id) -> float:
        engine.reset_prefix_cache()
        engine.add_request(EngineCoreRequest(tag, ids, params, lora_id=lora_id))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times = []
        while engine.has_unfinished_requests():
            engine.step()
            times.append(time.perf_counter())
        return (times[-1] - times[0]) / max(1, len(times) - 1) * 1e3  # decode ms/step

    one("warm-base", None)
    one("warm-lora", 1)
    base, tuned = [], []
    for k in range(args.iters):  # interleaved, so drift hits both
        base.append(one(f"base{k}", None))
        tuned.append(one(f"lora{k}", 1))
    b, t = min(base), min(tuned)
    print(f"batch-1 decode: base {b:.3f} ms/step, with a rank-{args.rank} adapter on all 7 projections {t:.3f} "
          f"ms/step = {t / b:.3f}x", flush=True)
    llm.shutdown()
    return {"base_ms": b, "lora_ms": t, "ratio": t / b, "base_runs": base, "lora_runs": tuned}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["throughput", "latency"])
    p.add_argument("--model", default="benchmarks/configs/qwen3-0.6b", help="a config directory (dummy weights)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--latency-input", type=int, default=128)
    p.add_argument("--latency-output", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--ab", action="store_true",
                   help="latency: the few-row path and the general kernels (lora.layers.FUSED_DECODE), an engine each")
    p.add_argument("--ab-gemv", action="store_true",
                   help="latency: the few-row expands as kernels of their own and in the base GEMVs' epilogues "
                        "(lora.layers.GEMV_EXPAND), an engine each")
    p.add_argument("--ab-fold", action="store_true",
                   help="latency: o_proj's shrink separate and folded into the decode attention's reduce "
                        "(lora.layers.FOLD_O_SHRINK), an engine each")
    p.add_argument("--norm-shrink-max-rows", type=int, default=None,
                   help="A/B: most rows for which the RMSNorm computes the qkv / gate_up shrink "
                        "(lora.layers.NORM_SHRINK_MAX_ROWS; beyond, the general shrink kernel)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    abs_given = [name for name in ("ab", "ab_gemv", "ab_fold") if getattr(args, name)]
    if len(abs_given) > 1 or (abs_given and args.mode != "latency"):
        p.error("--ab, --ab-gemv and --ab-fold are latency A/Bs, one per run")
    if args.norm_shrink_max_rows is not None:
        from pagedllm.lora import layers

        layers.NORM_SHRINK_MAX_ROWS = args.norm_shrink_max_rows

    from pagedllm.models.loader import load_hf_config

    hf_config = load_hf_config(args.model)
    tmp = tempfile.mkdtemp(prefix="pagedllm-lora-bench-")
    n = max(args.num_adapters) if args.mode == "throughput" else 1
    adapters = [write_dummy_adapter(os.path.join(tmp, f"a{i}"), hf_config, args.rank, seed=i) for i in range(n)]
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
              else None, "args": vars(args)}
    result[args.mode] = throughput(args, hf_config, adapters) if args.mode == "throughput" else latency(args, adapters)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
