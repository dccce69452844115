"""A decode step's attention with qkv_prep's work inside the attention kernel (PAGEDLLM_DECODE_PREP=1) against the
two launches (qkv_prep, then attention), by batch size and context, each captured in a CUDA graph and replayed,
the two alternating. It sets the batch size up to which the backend uses the decode prep.

    python benchmarks/decode_prep_ab.py [--heads 16,8 32,4] [--batches 1 4 16 64 256 512] [--contexts 256 1024]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_cases import build_batch  # noqa: E402
from gemv import graph_time_us  # noqa: E402

from pagedllm.attention.backend import QKVSpec  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.layers.rotary_embedding import get_rope  # noqa: E402


def case(num_heads: int, num_kv_heads: int, batch: int, context: int, reps: int, rounds: int) -> tuple[float, float]:
    head_size, dtype = 128, torch.bfloat16
    specs = [(context - 1, 1)] * batch
    b = build_batch(specs, num_heads, num_kv_heads, head_size, 16, dtype, "cuda", poison=False)
    qkv = torch.randn(batch, (num_heads + 2 * num_kv_heads) * head_size, device="cuda").to(dtype)
    positions = torch.full((batch,), context - 1, device="cuda", dtype=torch.int64)
    cos_sin = get_rope(head_size, 8192, {"rope_type": "default", "rope_theta": 1e6}).cos_sin_cache.to("cuda")
    norm = torch.ones(head_size, device="cuda", dtype=dtype)
    spec = QKVSpec(num_heads, num_kv_heads, head_size, b.scale, norm, norm, 1e-6)  # Qwen3's q / k norms
    backend = TritonAttentionBackend()
    times = {"1": [], "0": []}
    for _ in range(rounds):
        for on in ("1", "0"):  # (the choice is made while the graph is captured)
            os.environ["PAGEDLLM_DECODE_PREP"] = on
            src = qkv.clone()
            times[on].append(graph_time_us(
                lambda src=src: backend.forward_qkv(src, positions, cos_sin, b.kv_cache, b.metadata, spec), reps))
    os.environ.pop("PAGEDLLM_DECODE_PREP")
    return min(times["1"]), min(times["0"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", default=["16,8", "32,4"], help="q heads,kv heads (head size 128)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--contexts", nargs="+", type=int, default=[256, 1024])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}; us per layer (graph replay), prep inside attention vs qkv_prep + attention")
    print(f"{'heads':>6} {'ctx':>5} {'batch':>5} {'prep':>8} {'two':>8} {'two/prep':>8}")
    for heads in args.heads:
        nh, nkv = (int(x) for x in heads.split(","))
        for context in args.contexts:
            for batch in args.batches:
                prep, two = case(nh, nkv, batch, context, args.reps, args.rounds)
                print(f"{heads:>6} {context:>5} {batch:>5} {prep:8.2f} {two:8.2f} {two / prep:8.3f}", flush=True)


if __name__ == "__main__":
    main()
