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
    # the router's logits from the post-attention norm's kernel vs its own GEMV (norm + router + experts):
    PYTHONPATH=src python benchmarks/moe_variants/ab.py --norm-router --shape qwen3-30b-a3b --tokens 1 2 8
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
    p.add_argument("--norm-router", action="store_true",
                   help="instead: the post-attention norm + router + experts, the router's logits from the norm's "
                        "kernel (models/moe.NORM_ROUTER) vs the router's own GEMV")
    a = p.parse_args()
    if a.norm_router:
        return norm_router_ab(a)
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


def norm_router_ab(a):
    """The norm, the router and the experts as a decoder layer runs them (models/moe.SparseMoeBlock, RMSNorm), the
    router fused into the norm (its shrink_consumer link) or not."""
    from pagedllm.layers.layernorm import RMSNorm
    from pagedllm.models.moe import MoESpec, SparseMoeBlock
    import types

    E, k, H, I, renorm = SHAPES[a.shape]
    E = a.experts or E
    dev = "cpu" if INTERP else "cuda"
    torch.manual_seed(0)
    with torch.device(dev):
        block = SparseMoeBlock(types.SimpleNamespace(hidden_size=H, hidden_act="silu"),
                               MoESpec(num_experts=E, top_k=k, intermediate_size=I, renormalize=renorm), "mlp")
        norm = RMSNorm(H, eps=1e-6)
    block, norm = block.to(torch.bfloat16), norm.to(torch.bfloat16)
    with torch.no_grad():
        for w, scale in ((block.gate.weight, 3 * H ** -0.5), (block.experts.gate_up_proj, H ** -0.5),
                         (block.experts.down_proj, I ** -0.5)):
            w.copy_(torch.randn(w.shape, device=dev) * scale)
    for T in a.tokens:
        x = torch.randn(T, H, device=dev).to(torch.bfloat16)
        res = torch.randn(T, H, device=dev).to(torch.bfloat16)
        outs = {}
        for fused in (False, True):
            norm.__dict__["shrink_consumer"] = block if fused else None
            layer = lambda: block(norm(x, res)[0])  # noqa: E731
            outs[fused] = out = layer()
            line = f"T={T} router {'in the norm' if fused else 'alone      '}"
            if fused:
                line += f": max|out - alone| {(out.float() - outs[False].float()).abs().max().item():.3e}"
            if not a.check_only and not INTERP:
                line += f"  {graph_time_us(layer, a.iters):7.2f} us (norm + router + experts)"
            print(line, flush=True)


def graph_time_us(fn, iters):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from moe import _graph_time_us  # benchmarks/moe.py
    return _graph_time_us(fn, iters)


if __name__ == "__main__":
    main()
