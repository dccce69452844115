"""A/B of the few-token MoE GEMVs (kernels/fused_moe.py's GEMV path): the fenced kernels (weights loaded, a CTA
barrier, then activations and products; fused_moe.FENCED_GEMV, the default) against the K-step loops, both through
`fused_moe_routed` (the routing inside gate_up). Checks each against the reference and the two against each other
bit for bit (also on the CPU under TRITON_INTERPRET=1, small shapes); on a GPU, the layer time from CUDA-graph
replays (as benchmarks/moe.py) beside the bound (the picked experts' weights read once at 4.3 TB/s).

    # CPU, interpreter (correctness only, 16 experts; minutes):
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/moe_variants/ab.py --check-only --experts 16
    # GPU:
    PYTHONPATH=src python benchmarks/moe_variants/ab.py --shape qwen3-30b-a3b --tokens 1 2
    PYTHONPATH=src python benchmarks/moe_variants/ab.py --shape mixtral-8x7b --tokens 1
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from pagedllm.kernels import fused_moe as fm

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768, True), "mixtral-8x7b": (8, 2, 4096, 14336, False),
          "mixtral-tp8": (8, 2, 4096, 1792, False)}
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    p.add_argument("--experts", type=int, default=None, help="fewer experts (CPU check)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--check-only", action="store_true")
    a = p.parse_args()
    E, k, H, I, renorm = SHAPES[a.shape]
    E = a.experts or E
    dev = "cpu" if INTERP else "cuda"
    torch.manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device=dev) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev) * I ** -0.5).to(torch.bfloat16)
    default = fm.FENCED_GEMV
    for T in a.tokens:
        if T * k > fm.gemv_max_assignments(E, k):
            print(f"T={T}: past the GEMV path (m={T * k} > {fm.gemv_max_assignments(E, k)}); forced onto it")
        x = torch.randn(T, H, device=dev).to(torch.bfloat16)
        logits = torch.randn(T, E, device=dev).to(torch.bfloat16)
        ref_w, ref_ids = fm.moe_route_ref(logits, k, renorm)
        ref = fm.fused_moe_ref(x, w13, w2, ref_w, ref_ids).float()
        outs = {}
        for fenced in (False, True):
            fm.FENCED_GEMV = fenced
            gate, down = fm.gemv_plan(T, H, I, k)
            layer = lambda: fm.fused_moe_routed(x, logits, w13, w2, k, renorm, path="gemv")  # noqa: E731
            outs[fenced] = out = layer()
            line = (f"T={T} {'fenced' if fenced else 'loops':6s} gate_up {gate} down {down}: "
                    f"max|out-ref| {(out.float() - ref).abs().max().item():.3e}")
            if fenced:
                line += f", bitwise == loops {torch.equal(out, outs[False])}"
            if not a.check_only and not INTERP:
                us = graph_time_us(layer, a.iters)
                bound = int(torch.unique(ref_ids).numel()) * 3 * H * I * 2 / 4.3e12 * 1e6
                line += f"  {us:7.2f} us ({us / bound:.2f}x the {bound:.1f} us bound)"
            print(line, flush=True)
        fm.FENCED_GEMV = default


def graph_time_us(fn, iters):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from moe import _graph_time_us  # benchmarks/moe.py
    return _graph_time_us(fn, iters)


if __name__ == "__main__":
    main()
