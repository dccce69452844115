"""--cpu-offload-gb cost: decode and prefill speed with N GB of weights streamed from pinned host memory vs all
weights resident, same process, same requests, interleaved runs (GPU only).

    PYTHONUNBUFFERED=1 python benchmarks/cpu_offload.py --offload-gb 0.5 1.0 --num-prompts 32 --output-len 64

Model: a Qwen3-0.6B-shaped config with dummy weights (bf16) unless --model is given. Prints one JSON line per
run: offloaded GB, output tok/s, and the ratio to the resident run.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def qwen3_0_6b_dir() -> str:
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    path = tempfile.mkdtemp(prefix="pagedllm-offload-bench-")
    cfg.save_pretrained(path)
    return path


def run(model: str, load_format: str, gb: float, prompts: list, out_len: int) -> float:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=model, load_format=load_format, dtype="bfloat16", device="cuda", cpu_offload_gb=gb,
              skip_tokenizer_init=True, max_model_len=2048, enforce_eager=gb == 0 and ARGS.eager_baseline)
    params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    llm.shutdown()  # the GPU back before the next run
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--offload-gb", type=float, nargs="+", default=[0.5])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--eager-baseline", action="store_true", help="resident run without CUDA graphs too")
    global ARGS
    ARGS = p.parse_args()
    model, load_format = (ARGS.model, "auto") if ARGS.model else (qwen3_0_6b_dir(), "dummy")
    prompts = [{"prompt_token_ids": [(7 * i + j) % 30000 + 10 for j in range(ARGS.input_len)]}
               for i in range(ARGS.num_prompts)]
    for rep in range(ARGS.repeats):
        base = run(model, load_format, 0, prompts, ARGS.output_len)
        print(json.dumps({"repeat": rep, "offload_gb": 0, "tok_s": round(base, 1)}), flush=True)
        for gb in ARGS.offload_gb:
            tps = run(model, load_format, gb, prompts, ARGS.output_len)
            print(json.dumps({"repeat": rep, "offload_gb": gb, "tok_s": round(tps, 1),
                              "vs_resident": round(tps / base, 3)}), flush=True)


ARGS = None

if __name__ == "__main__":
    main()
