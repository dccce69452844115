"""A/B of the MoE GEMV variants (moe_variants.py) against the launcher's kernels: correctness (also on CPU under
TRITON_INTERPRET=1, small shapes) and, on a GPU, the layer time from CUDA-graph replays (as benchmarks/moe.py).

    # CPU, interpreter (correctness only, 16 experts; minutes):
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/moe_variants/ab.py --check-only --experts 16
    # GPU (layer us from CUDA-graph replays, and the same checks at the real shapes):
    PYTHONPATH=src python benchmarks/moe_variants/ab.py --shape qwen3-30b-a3b --tokens 1 2
    PYTHONPATH=src python benchmarks/moe_variants/ab.py --shape mixtral-8x7b --tokens 1
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pagedllm.kernels import fused_moe as fm  # noqa: E402
from pagedllm.kernels.pdl import pdl_launch_args  # noqa: E402
import moe_variants as mv  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768, True), "mixtral-8x7b": (8, 2, 4096, 14336, False)}
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_args(dev):
    return {"USE_PDL": False} if INTERP else pdl_launch_args(dev)


def layer(x, logits, w13, w2, top_k, renorm, gate="launcher", down="launcher", gate_bn=None, gate_w=4,
          down_bn=None, down_w=None):
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    m = T * top_k
    la = launch_args(x.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=x.device)
    wts = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    act = torch.empty((m, I), dtype=x.dtype, device=x.device)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    bn0, bk = fm._gemv_gate_up_blocks(H)
    bn = gate_bn or bn0
    route = fm._route_meta(E, top_k)
    extra = {} if gate == "launcher" else {"COPIES": gate_w}
    fn = {"launcher": fm._gemv_gate_up_kernel, "warp": mv.gate_up_warp_route,
          "warp-fenced": mv.gate_up_warp_route_fenced}[gate]
    fn[(m, triton.cdiv(I, bn))](x, w13, ids, wts, logits, act, I, E, x.stride(0), logits.stride(0), w13.stride(0),
                                w13.stride(1), act.stride(0), K=H, **route, ROUTE=True, RENORMALIZE=renorm,
                                BLOCK_N=bn, BLOCK_K=bk, num_warps=gate_w, **extra, **la)
    dbn0, dbk, dw0 = fm._gemv_down_blocks(T, H, I)
    dbn, dw = down_bn or dbn0, down_w or dw0
    common = (H, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0))
    if down == "launcher":
        fm._gemv_down_sum_kernel[(T, triton.cdiv(H, dbn))](act, w2, ids, wts, out, *common, K=I, TOP_K=top_k,
                                                           BLOCK_N=dbn, BLOCK_K=dbk, num_warps=dw, **la)
    elif down == "fenced":
        kp = max(2, triton.next_power_of_2(top_k))
        mv.down_all_fenced[(T, triton.cdiv(H, dbn))](act, w2, ids, wts, out, *common, K=I, TOP_K=top_k, K_PAD=kp,
                                                     BLOCK_N=dbn, BLOCK_K=triton.next_power_of_2(I), num_warps=dw,
                                                     **la)
    elif down == "chunks":
        kp = max(2, triton.next_power_of_2(top_k))
        mv.down_chunks_fenced[(T, triton.cdiv(H, dbn))](act, w2, ids, wts, out, *common, K=I, TOP_K=top_k, K_PAD=kp,
                                                        BLOCK_N=dbn, BLOCK_K=min(256, triton.next_power_of_2(I)),
                                                        num_warps=dw, **la)
    elif down == "prefetch":
        kp = max(2, triton.next_power_of_2(top_k))
        mv.down_route_prefetch[(T, triton.cdiv(H, dbn))](
            act, w2, logits, out, H, E, logits.stride(0), act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
            K=I, TOP_K=top_k, K_PAD=kp, E_PAD=route["E_PAD"], RENORMALIZE=renorm, BLOCK_N=dbn,
            BLOCK_K=triton.next_power_of_2(I), num_warps=dw, COPIES=dw, **la)
    return out, ids, wts


VARIANTS = [  # (name, kwargs)
    ("launcher", {}),
    ("down fenced BN2 w4", dict(down="fenced", down_bn=2, down_w=4)),
    ("down fenced BN4 w4", dict(down="fenced", down_bn=4, down_w=4)),
    ("down prefetch BN2 w4", dict(down="prefetch", down_bn=2, down_w=4)),
    ("down chunks BN2 w4", dict(down="chunks", down_bn=2, down_w=4)),
    ("down chunks BN4 w8", dict(down="chunks", down_bn=4, down_w=8)),
    ("gate warp-route", dict(gate="warp")),
    ("gate warp-route fenced BN4 w4", dict(gate="warp-fenced", gate_bn=4, gate_w=4)),
    ("gate warp-route fenced BN8 w8", dict(gate="warp-fenced", gate_bn=8, gate_w=8)),
    ("gate warp-route + down fenced BN2", dict(gate="warp", down="fenced", down_bn=2, down_w=4)),
    ("gate warp fenced BN4 + down fenced BN2", dict(gate="warp-fenced", gate_bn=4, down="fenced", down_bn=2,
                                                    down_w=4)),
    ("gate warp-route + down prefetch BN2", dict(gate="warp", down="prefetch", down_bn=2, down_w=4)),
    ("gate warp-route + down chunks BN2 w4", dict(gate="warp", down="chunks", down_bn=2, down_w=4)),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    p.add_argument("--experts", type=int, default=None, help="fewer experts (CPU check)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--only", default=None, help="regex on the variant names (the launcher always runs)")
    a = p.parse_args()
    E, k, H, I, renorm = SHAPES[a.shape]
    E = a.experts or E
    dev = "cpu" if INTERP else "cuda"
    torch.manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device=dev) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev) * I ** -0.5).to(torch.bfloat16)
    hbm = 4.3e12
    for T in a.tokens:
        if T * k > fm.gemv_max_assignments(E, k) and not a.experts:
            print(f"T={T}: not on the GEMV path (m={T * k} > {fm.gemv_max_assignments(E, k)}); still compared")
        x = torch.randn(T, H, device=dev).to(torch.bfloat16)
        logits = torch.randn(T, E, device=dev).to(torch.bfloat16)
        ref_w, ref_ids = fm.moe_route_ref(logits, k, renorm)
        ref = fm.fused_moe_ref(x, w13, w2, ref_w, ref_ids).float()
        base = None
        for name, kw in VARIANTS:
            if I > 1024 and kw.get("down", "launcher") != "launcher":
                continue  # the fenced / chunked / prefetch down kernels hold a whole row: K <= 1024 only
            if a.only and name != "launcher" and not __import__("re").search(a.only, name):
                continue
            out, ids, wts = layer(x, logits, w13, w2, k, renorm, **kw)
            err = (out.float() - ref).abs().max().item()
            same = base is None or torch.equal(out, base)
            if base is None:
                base = out
            ok = torch.equal(ids.long(), ref_ids.long()) if kw.get("down") != "prefetch" or True else True
            line = f"T={T} {name:40s} max|out-ref| {err:.3e} bitwise==launcher {same} ids==ref {ok}"
            if not a.check_only and not INTERP:
                us = fm_time(lambda kw=kw: layer(x, logits, w13, w2, k, renorm, **kw), a.iters)
                experts = int(torch.unique(ref_ids).numel())
                bound = (experts * 3 * H * I * 2) / hbm * 1e6
                line += f"  {us:7.2f} us  ({us / bound:.2f}x the {bound:.1f} us bound)"
            print(line, flush=True)


def fm_time(fn, iters):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from moe import _graph_time_us  # benchmarks/moe.py
    return _graph_time_us(fn, iters)


if __name__ == "__main__":
    main()
