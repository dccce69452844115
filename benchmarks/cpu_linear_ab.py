"""A/B of the CPU fp32 matmul paths on one loaded model (SmolLM2 by default): oneDNN `_linear_pointwise` with
reordered weights (what pagedllm uses) vs `mkldnn_linear` on mkldnn tensors vs plain F.linear (MKL sgemm).
Same requests each round; prints prefill time and decode ms/step per path, twice, interleaved.

    python benchmarks/cpu_linear_ab.py [--model PATH] [--requests 18]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

import pagedllm.layers.linear as linear
import pagedllm.layers.vocab_embedding as vocab
from pagedllm import LLM, SamplingParams
from pagedllm.core.engine_core import EngineCoreRequest


def use_path(model: torch.nn.Module, mode: str) -> None:
    for module in model.modules():
        if "cpu_packed_weight" not in module.__dict__:
            continue
        w = module.weight.detach()
        module.__dict__["cpu_packed_weight"] = {
            "pointwise": lambda: torch.ops.mkldnn._reorder_linear_weight(w, 32),
            "mkldnn": lambda: w.to_mkldnn(),
            "sgemm": lambda: w,
        }[mode]()

    def mkldnn_path(x, packed, bias):
        out = torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), packed, None).to_dense()
        return out if bias is None else out.add_(bias)

    fn = {"pointwise": lambda x, p, b: torch.ops.mkldnn._linear_pointwise(x.contiguous(), p, b, "none", [], ""),
          "mkldnn": mkldnn_path,
          "sgemm": lambda x, p, b: torch.nn.functional.linear(x, p, b)}[mode]
    linear.cpu_packed_linear = fn
    vocab.cpu_packed_linear = fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=18)
    p.add_argument("--decode-steps", type=int, default=30)
    args = p.parse_args()
    llm = LLM(model=args.model, dtype="float32", num_gpu_blocks_override=4096)
    eng = llm.engine
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(rng.randint(16, 160))] for _ in range(args.requests)]
    for round_ in range(2):
        for mode in ("pointwise", "mkldnn", "sgemm"):
            use_path(eng.worker.model, mode)
            for i, ids in enumerate(prompts):
                eng.add_request(EngineCoreRequest(f"{mode}-{round_}-{i}", ids, SamplingParams(
                    temperature=0, max_tokens=args.decode_steps + 10, ignore_eos=True)))
            eng.reset_prefix_cache()
            t = time.perf_counter()
            eng.step()
            prefill = time.perf_counter() - t
            for _ in range(4):
                eng.step()
            t = time.perf_counter()
            for _ in range(args.decode_steps):
                eng.step()
            decode = (time.perf_counter() - t) / args.decode_steps
            print(f"{mode:10s} prefill {prefill * 1e3:7.0f} ms   decode {decode * 1e3:6.1f} ms/step "
                  f"({args.requests} requests)")
            while eng.has_unfinished_requests():
                eng.step()


if __name__ == "__main__":
    main()
