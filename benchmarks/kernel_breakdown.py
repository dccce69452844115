"""Where an offline run's device time goes, by kernel and by kind of kernel (torch profiler, CUDA activity).

    python benchmarks/kernel_breakdown.py --model benchmarks/configs/llama3-8b --load-format dummy \
        --num-prompts 250 --input-len 512 --output-len 256 --temperature 0.8 [--quantization fp8]
    python benchmarks/kernel_breakdown.py --model benchmarks/configs/qwen3-0.6b --load-format dummy \
        --lora-adapters 4 --lora-rank 16      # requests spread over 4 dummy adapters (lora.py's), max_loras 16

Runs one warm-up generate, then under the profiler (kernels inside CUDA-graph replays included) the prompts'
prefill alone (one output token each) and the whole run, and prints for each: wall time, the sum of kernel time
(device busy), each kind's share (GEMM, activation quantization, attention, norms, ...) and the top kernels with
their count and mean; then the decode phase's kinds as the difference. Profiling adds host time, so the wall
time here is not a throughput figure; the kernel sums are what to compare between two configurations.
A kernel launched with programmatic dependent launch (kernels/pdl.py) starts while the one before it finishes and
waits for it, so its time includes that overlap: with PDL on, the sum can pass the wall time and a small PDL
kernel after a long one looks long (PAGEDLLM_PDL=0 gives each kernel its own time, at some cost in launches).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
from collections import defaultdict

import torch

KINDS = [  # first match wins (pagedllm's Triton kernels by name, cuBLAS's by its kernel names: "qq" = FP8 inputs)
    ("lora", r"lora|_shrink|_expand"),
    ("activation quant", r"quant_act|_per_token_kernel|per_token_quant|dynamic.*quant"),
    ("attention", r"^_prefill_kernel|^_decode_kernel|^_decode_reduce|verify_attention|attention|attn|flash|fmha"),
    ("gemm fp8/int8", r"w8a8|scaled_mm|f8f8|e4m3|int8_gemm|_int_mm|i8i8|s8s8|imma|nvjet_sm\d+_qq"),
    ("gemv/gemm int4", r"qgemv|qgemm|gptq|awq|int4|marlin|dequant"),
    ("gemm bf16", r"gemm|gemv|nvjet|cutlass|xmma|matmul|splitk|sm90|sm80|ampere|hopper"),
    ("norm", r"rms|norm"),
    ("rope", r"rope|rotary|qkv_prep"),
    ("activation", r"silu|gelu|act_and_mul|swiglu"),
    ("sampling", r"sampl|argmax|topk|top_k|softmax|multinomial|exponential|gumbel|penalt"),
    ("embedding", r"embed|index_select|gather"),
    ("copy/fill", r"copy|memcpy|memset|fill|elementwise"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=250)
    p.add_argument("--input-len", type=int, nargs="+", default=[512],
                   help="tokens per prompt: one value, or LO HI (uniform, as offline_throughput.py's nano protocol)")
    p.add_argument("--output-len", type=int, nargs="+", default=[256], help="one value, or LO HI")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--lora-adapters", type=int, default=0,
                   help="spread the requests over this many dummy adapters (an engine with enable_lora, max_loras 16)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--json", default=None, help="write the per-kernel table here")
    args = p.parse_args()
    from pagedllm import LLM, SamplingParams

    kwargs = dict(model=args.model, dtype=args.dtype, load_format=args.load_format, skip_tokenizer_init=True,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    lora_requests = None
    if args.lora_adapters:
        lora_requests = dummy_adapters(args, kwargs)
    llm = LLM(**kwargs)
    rng = random.Random(0)
    def length(bounds: list[int]) -> int:
        return rng.randint(bounds[0], bounds[-1])

    prompts = [{"prompt_token_ids": [rng.randrange(10, 30000) for _ in range(length(args.input_len))]}
               for _ in range(args.num_prompts)]
    params = [SamplingParams(temperature=args.temperature, max_tokens=length(args.output_len), ignore_eos=True)
              for _ in prompts]
    warm = prompts[:max(8, args.lora_adapters)]
    llm.generate(warm, SamplingParams(temperature=args.temperature, max_tokens=8, ignore_eos=True),
                 lora_request=lora_requests[:len(warm)] if lora_requests else None, use_tqdm=False)
    llm.engine.reset_prefix_cache()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    # the prefill alone first (each prompt with one output token), then the whole run: decode ~ the difference
    runs = {}
    for phase, phase_params in (("prefill", SamplingParams(temperature=args.temperature, max_tokens=1,
                                                           ignore_eos=True)), ("all", params)):
        llm.engine.reset_prefix_cache()  # no prefix-cache hits from the run before
        sync()
        runs[phase] = profiled(llm, prompts, phase_params, sync, lora_requests)
    report = {}
    for phase, (wall, per) in runs.items():
        report[phase] = print_table(phase, wall, per, args.top if phase == "all" else min(args.top, 12))
    print("\ndecode ~ all - prefill, s by kind:")
    for kind in sorted(report["all"]["kinds"], key=lambda k: -report["all"]["kinds"][k]):
        print(f"{kind:<20} {report['all']['kinds'][kind] - report['prefill']['kinds'].get(kind, 0.0):8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def dummy_adapters(args, kwargs: dict) -> list:
    """lora.py's random PEFT adapters on every projection, one request each in turn (round robin)."""
    import sys
    import tempfile

    from transformers import AutoConfig

    from pagedllm import LoRARequest

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from lora import write_dummy_adapter

    hf_config = AutoConfig.from_pretrained(args.model)
    root = tempfile.mkdtemp(prefix="kb-lora-")
    adapters = [LoRARequest(f"a{i}", i + 1, write_dummy_adapter(os.path.join(root, f"a{i}"), hf_config,
                                                                  args.lora_rank, seed=i))
                for i in range(args.lora_adapters)]
    kwargs.update(enable_lora=True, max_loras=max(16, args.lora_adapters), max_lora_rank=args.lora_rank)
    return [adapters[i % len(adapters)] for i in range(max(args.num_prompts, len(adapters)))]


def profiled(llm, prompts, params, sync, lora_requests=None) -> tuple[float, dict]:
    """(wall s, kernel name -> [count, us]) of one generate under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    # off CUDA (a check of this script) the CPU ops stand in for the kernels
    on_cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, lora_request=lora_requests[:len(prompts)] if lora_requests else None,
                     use_tqdm=False)
        sync()
        wall = time.perf_counter() - t0
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if on_cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        per[ev.name][0] += 1
        per[ev.name][1] += ev.time_range.elapsed_us()
    return wall, per


def print_table(phase: str, wall: float, per: dict, top: int) -> dict:
    busy = sum(us for _, us in per.values()) / 1e6
    by_kind = defaultdict(float)
    for name, (_, us) in per.items():
        by_kind[kind_of(name)] += us / 1e6
    print(f"\n== {phase}: wall {wall:.2f} s under the profiler; kernels {busy:.2f} s ({busy / wall:.0%} of wall)")
    print(f"{'kind':<20} {'s':>8} {'share':>7}")
    for kind, s in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"{kind:<20} {s:8.3f} {s / busy:7.1%}")
    print(f"\n{'kernel':<90} {'count':>8} {'total s':>8} {'mean us':>9} kind")
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])
    for name, (n, us) in rows[:top]:
        print(f"{name[:90]:<90} {n:8d} {us / 1e6:8.3f} {us / n:9.1f} {kind_of(name)}")
    return {"wall_s": wall, "busy_s": busy, "kinds": dict(by_kind), "kernels": [[name, n, us] for name, (n, us) in rows]}

if __name__ == "__main__":
    main()
