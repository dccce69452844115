"""Single-batch latency: time per output token, pagedllm vs HF transformers `generate`, same weights, same run.

    python benchmarks/latency.py --model benchmarks/configs/llama3-8b --load-format dummy \
        --batch-size 1 --input-len 128 --output-len 256

Prints ms per output token (decode steps only, and end to end), the hardware bound (weight + KV bytes per
decode step over the measured ~4.3 TB/s copy bandwidth), and the ratio to HF.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

HBM_BYTES_PER_S = 4.3e12


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p.add_argument("--device-sampling", choices=["auto", "on", "off"], default="auto",
                   help="A/B of the CUDA sampler kernel (off: the general path of torch ops)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", default=None, help="e.g. fp8 (online W8A8); quantized checkpoints are detected")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--hf", choices=["generate", "none"], default="generate")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from pagedllm import LLM, SamplingParams
    from pagedllm.core.engine_core import EngineCoreRequest

    t0 = time.perf_counter()
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, skip_tokenizer_init=True,
              enforce_eager=args.enforce_eager, max_num_seqs=max(args.batch_size, 8),
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              max_model_len=args.max_model_len or (args.input_len + args.output_len + 16))
    startup = time.perf_counter() - t0
    if args.device_sampling != "auto":  # the engine runs in this process
        from pagedllm.layers import sampler as sampler_mod

        sampler_mod.DEVICE_SAMPLING = args.device_sampling == "on"
    engine = llm.engine
    rng = random.Random(0)
    vocab = min(engine.vocab_size, 32000)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def one_run(tag):
        for i, ids in enumerate(prompts):
            engine.add_request(EngineCoreRequest(f"{tag}-{i}", ids, params))
        engine.reset_prefix_cache()
        sync()
        start = time.perf_counter()
        step_times = []
        while engine.has_unfinished_requests():
            engine.step()
            step_times.append(time.perf_counter())
        total = step_times[-1] - start
        ttft = step_times[0] - start
        decode = (step_times[-1] - step_times[0]) / max(1, len(step_times) - 1)
        return total, ttft, decode

    one_run("warmup")
    runs = [one_run(f"run{k}") for k in range(args.iters)]
    total, ttft, decode = min(runs, key=lambda r: r[0])
    cfg = engine.worker.hf_config
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.worker.model.parameters())
    spec = engine.worker.runner.kv_cache_spec()
    avg_ctx = args.input_len + args.output_len / 2
    kv_bytes = spec.bytes_per_token * avg_ctx * args.batch_size
    bound_ms = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
              else None, "args": vars(args), "startup_s": startup, "ttft_ms": ttft * 1e3,
              "decode_ms_per_step": decode * 1e3, "e2e_ms_per_token": total / args.output_len * 1e3,
              "hardware_bound_ms": bound_ms, "fraction_of_bound": bound_ms / (decode * 1e3)}
    print(f"pagedllm: startup {startup:.1f} s, TTFT {ttft * 1e3:.1f} ms, decode {decode * 1e3:.3f} ms/step "
          f"(batch {args.batch_size}), end-to-end {total / args.output_len * 1e3:.3f} ms/token")
    print(f"hardware bound {bound_ms:.2f} ms/step ({weight_bytes / 1e9:.2f} GB weights + {kv_bytes / 1e9:.3f} GB KV "
          f"at {HBM_BYTES_PER_S / 1e12:.1f} TB/s): pagedllm reaches {bound_ms / (decode * 1e3) * 100:.0f}% of it")
    model_dir = engine.model_dir
    del engine
    llm.shutdown()  # the device back for the transformers run
    if args.hf == "generate":
        from transformers import AutoConfig, AutoModelForCausalLM

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        cfg = AutoConfig.from_pretrained(model_dir)
        if args.load_format == "dummy":
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        model.eval()
        ids = torch.tensor(prompts, device=device)
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            sync()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False)
            sync()
            hf_total = time.perf_counter() - t
        hf_ms = hf_total / args.output_len * 1e3
        result["hf_generate_ms_per_token"] = hf_ms
        result["speedup_vs_hf"] = hf_ms / (total / args.output_len * 1e3)
        print(f"HF generate: {hf_ms:.2f} ms/token; pagedllm is {result['speedup_vs_hf']:.1f}x faster end to end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
