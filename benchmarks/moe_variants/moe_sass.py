"""sm_90 machine-code analysis of the MoE GEMV kernels (pagedllm kernels/fused_moe.py) at few tokens, as the
launcher runs them (fused_moe.gemv_plan) and with the K-step loops (fused_moe.FENCED_GEMV off): grid and waves,
registers, CTAs per SM, the weight loads each thread has outstanding at once (a walk of the SASS) and the bytes in
flight per SM. Reuses benchmarks/kernel_sass.py; no GPU.

    PYTHONPATH=src python benchmarks/moe_variants/moe_sass.py [--which launcher|loops|all] [--only REGEX] \
        [--dump DIR] [--json F]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
warnings.filterwarnings("ignore")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernel_sass as ks  # noqa: E402
from pagedllm.kernels import fused_moe as fm  # noqa: E402

SMS = 132
SHAPES = {"qwen3-30b-a3b": dict(H=2048, I=768, E=128, k=8), "mixtral-8x7b": dict(H=4096, I=14336, E=8, k=2)}
PTR = {"ids_ptr": "*i32", "weights_ptr": "*fp32", "topk_w_ptr": "*fp32"}  # the rest: bf16


def compile_kernel(fn, ints: dict, const: dict, warps: int, stages: int = 3):
    sig, constexprs, attrs = {}, {}, {}
    for p in fn.params:
        if p.is_constexpr:
            constexprs[p.name] = const[p.name] if p.name in const else p.default
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = PTR.get(p.name, "*bf16")
            attrs[(p.num,)] = [["tt.divisibility", 16]]
        else:
            v = ints[p.name]
            sig[p.name] = "i32"
            if v == 1:  # the JIT specializes 1 as a constant
                sig[p.name], constexprs[p.name] = "constexpr", 1
            elif not p.do_not_specialize and v % 16 == 0:
                attrs[(p.num,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True))


REG = re.compile(r"\bR(\d+)(\.64)?\b")


def regs_of(tok: str, width: int = 1) -> set:
    out = set()
    for m in REG.finditer(tok):
        n = int(m.group(1))
        w = 2 if m.group(2) else width
        out.update(range(n, n + w))
    return out


def ldg_bytes(op: str) -> int:
    for suf, b in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1)):
        if suf in op:
            return b
    return 4


def load_flow(ins: list) -> dict:
    """Walk the SASS in order: a global load stays outstanding until an instruction reads (or rewrites) its
    destination registers. Weight loads: the evict_first ones (LDG.E.EF.*)."""
    pending = []  # (regs, bytes, is_weight)
    max_w_bytes = max_w_n = 0
    groups = 0
    consumed_since_issue = True
    wait_at = next((i for i, (_, t) in enumerate(ins) if t.startswith("ACQBULK")), None)
    w_before_wait = 0
    bars = 0
    first_w = next((i for i, (_, t) in enumerate(ins) if t.startswith("LDG") and ".EF" in t.split()[0]), len(ins))
    pre = [t.split()[0] for _, t in ins[:first_w]]
    pre_stats = dict(instr_before_first_w=len(pre), bar_before_first_w=sum(o.startswith("BAR") for o in pre),
                     shfl_before_first_w=sum(o.startswith("SHFL") for o in pre),
                     ldg_before_first_w=sum(o.startswith("LDG") for o in pre))
    for i, (_, text) in enumerate(ins):
        op, _, rest = text.partition(" ")
        operands = [o.strip() for o in rest.split(",")] if rest else []
        if op.startswith("BAR"):
            bars += 1
        is_store = op.startswith(("ST", "RED", "BAR", "BRA", "EXIT"))
        dest = set() if is_store or not operands else regs_of(operands[0])
        reads = set()
        for o in (operands if is_store else operands[1:]):
            reads |= regs_of(o)
        if op.startswith("STG") and operands:  # the data operand of a 128-bit store covers 4 registers
            reads |= regs_of(operands[-1], ldg_bytes(op) // 4)
        # consume
        kept = []
        for p in pending:
            if p[0] & reads or p[0] & dest:
                if p[2]:
                    consumed_since_issue = True
            else:
                kept.append(p)
        pending = kept
        if op.startswith("LDG"):
            b = ldg_bytes(op)
            w = ".EF" in op
            pending.append((regs_of(operands[0], max(1, b // 4)), b, w))
            if w:
                if consumed_since_issue:
                    groups += 1
                    consumed_since_issue = False
                if wait_at is not None and i < wait_at:
                    w_before_wait += 1
            wb = sum(p[1] for p in pending if p[2])
            wn = sum(1 for p in pending if p[2])
            max_w_bytes, max_w_n = max(max_w_bytes, wb), max(max_w_n, wn)
    return dict(max_weight_ldg_outstanding=max_w_n, max_weight_bytes_outstanding=max_w_bytes, weight_ldg_groups=groups,
                weight_ldg_before_wait=w_before_wait, bar_sync=bars, has_wait=wait_at is not None, **pre_stats)


def analyze(name, fn, ints, const, warps, grid, weight_bytes_per_program, dump=None):
    kernel = compile_kernel(fn, ints, const, warps)
    tools = ks.nvidia_tools()
    sass, regs = ks.cubin_sass(tools["cuobjdump"], kernel.asm["cubin"])
    info = ks.ptxas_info(tools["ptxas"], kernel.asm["ptx"])
    if dump:
        os.makedirs(dump, exist_ok=True)
        base = os.path.join(dump, re.sub(r"[^\w.-]+", "_", name))
        for ext in ("ttgir", "ptx"):
            open(f"{base}.{ext}", "w").write(kernel.asm[ext])
        open(f"{base}.sass", "w").write(sass)
    ins = ks.parse_sass(sass)
    mix, ops = ks.instruction_mix(ins, ins[0][0], ins[-1][0])  # straight-line (unrolled): the whole kernel
    ldg = {op: n for op, n in ops.items() if op.startswith("LDG")}
    flow = load_flow(ins)
    w_ldg = sum(n for op, n in ldg.items() if ".EF" in op)
    occ = ks.ctas_per_sm(regs, kernel.metadata.shared, warps)
    programs = math.prod(grid)
    resident = min(occ["fit"], math.ceil(programs / SMS))
    # bytes a CTA has in flight at its peak: its weights x (outstanding weight LDGs at peak / all its weight LDGs)
    cta_inflight = weight_bytes_per_program * flow["max_weight_ldg_outstanding"] / max(1, w_ldg)
    kb = weight_bytes_per_program / 1024
    return dict(name=name, grid=grid, programs=programs, warps=warps, constexprs=const, regs=regs,
                spill_stores=info["spill_stores"], spill_loads=info["spill_loads"], shared=kernel.metadata.shared,
                ctas_per_sm=occ, programs_per_sm=programs / SMS, waves=programs / (SMS * occ["fit"]),
                weight_bytes_per_program=weight_bytes_per_program, ldg=ldg, weight_ldg_per_thread=w_ldg, **flow,
                cta_inflight_bytes=cta_inflight, sm_inflight_bytes=resident * cta_inflight,
                instructions=mix["total"], instr_per_kb=mix["total"] / kb,
                mix_per_kb={k: round(v / kb, 1) for k, v in mix.items() if v},
                top_ops=dict(ops.most_common(12)))


# ---------------------------------------------------------------------------------------- the cases


def gate_up_case(shape, T, fn=None, block_n=None, block_k=None, warps=4, extra=None, tag="launcher"):
    s = SHAPES[shape]
    H, I, E, k = s["H"], s["I"], s["E"], s["k"]
    bn0, bk0 = fm._gemv_gate_up_blocks(H)
    bn, bk = block_n or bn0, block_k or bk0
    fn = fn or fm._gemv_gate_up_kernel
    ints = dict(N=I, E=E, stride_xm=H, stride_lt=E, stride_we=2 * I * H, stride_wn=H, stride_om=I)
    const = dict(K=H, **fm._route_meta(E, k), ROUTE=True, RENORMALIZE=shape.startswith("qwen"), BLOCK_N=bn,
                 BLOCK_K=bk, USE_PDL=True, **(extra or {}))
    grid = (T * k, triton.cdiv(I, bn * const.get("ROW_BLOCKS", 1)))
    wbytes = 2 * bn * const.get("ROW_BLOCKS", 1) * H * 2
    return (f"{shape} T={T} gate_up {tag} BN{bn} BK{bk} w{warps}", fn, ints, const, warps, grid, wbytes)


def down_case(shape, T, fn=None, block_n=None, block_k=None, warps=None, extra=None, tag="launcher"):
    s = SHAPES[shape]
    H, I, E, k = s["H"], s["I"], s["E"], s["k"]
    bn0, bk0, w0 = fm._gemv_down_blocks(T, H, I)
    bn, bk, warps = block_n or bn0, block_k or bk0, warps or w0
    fn = fn or fm._gemv_down_sum_kernel
    ints = dict(N=H, stride_am=I, stride_we=H * I, stride_wn=I, stride_om=H)
    const = dict(K=I, TOP_K=k, BLOCK_N=bn, BLOCK_K=bk, USE_PDL=True, **(extra or {}))
    if "K_PAD" in [p.name for p in fn.params]:
        const["K_PAD"] = fm._k_pad(k)
    grid = (T, triton.cdiv(H, bn))
    if "SPLIT_K" in const:
        grid = (T, triton.cdiv(H, bn), const["SPLIT_K"])
    wbytes = k * bn * I * 2 // const.get("SPLIT_K", 1)
    return (f"{shape} T={T} down {tag} BN{bn} BK{bk} w{warps}" + (f" split{const['SPLIT_K']}" if "SPLIT_K" in const
                                                                  else ""), fn, ints, const, warps, grid, wbytes)


def cases(which):
    out = []
    for fenced, tag in ((True, "launcher"), (False, "loops")):
        if which not in ("all", tag):
            continue
        fm.FENCED_GEMV = fenced
        for shape in SHAPES:
            s = SHAPES[shape]
            for T in (1, 2):
                gate, down = fm.gemv_plan(T, s["H"], s["I"], s["k"])
                g_tag, d_tag = (f"{tag}{' fenced' if d['FENCED'] else ''}" for d in (gate, down))
                out.append(gate_up_case(shape, T, block_n=gate["BLOCK_N"], block_k=gate["BLOCK_K"],
                                        warps=gate["num_warps"], tag=g_tag,
                                        extra=dict(FENCED=gate["FENCED"], COPIES=gate["num_warps"])))
                out.append(down_case(shape, T, fn=fm._gemv_down_fenced_kernel if down["FENCED"] else None,
                                     block_n=down["BLOCK_N"], block_k=down["BLOCK_K"], warps=down["num_warps"],
                                     tag=d_tag))
    fm.FENCED_GEMV = True
    return out


def table(rows):
    h = ("| kernel | grid (progs / per SM) | regs | spill | smem | CTAs/SM fit (regs/smem) | waves | W KB/prog "
         "| wait before W? W-LDG before wait | LDG per thread (kinds) | W-LDG outstanding max (groups) | BAR "
         "| KB in flight / CTA | / SM | before 1st W-LDG: instr / BAR / SHFL / LDG | instr/thread | per KB W |")
    out = [h, "|" + "---|" * (h.count("|") - 1)]
    for r in rows:
        occ = r["ctas_per_sm"]
        kinds = ", ".join(f"{n} {op}" for op, n in sorted(r["ldg"].items()))
        out.append(
            f"| {r['name']} | {r['programs']} / {r['programs_per_sm']:.1f} | {r['regs']} | "
            f"{r['spill_stores']}/{r['spill_loads']} | {r['shared']} | "
            f"{occ['fit']} ({occ['by_regs']}/{occ['by_smem']}) "
            f"| {r['waves']:.2f} | {r['weight_bytes_per_program'] / 1024:.1f} | "
            f"{'yes' if r['has_wait'] else 'no wait'} {r['weight_ldg_before_wait']} | {kinds} | "
            f"{r['max_weight_ldg_outstanding']} of {r['weight_ldg_per_thread']} ({r['weight_ldg_groups']}) | "
            f"{r['bar_sync']} | {r['cta_inflight_bytes'] / 1024:.1f} | {r['sm_inflight_bytes'] / 1024:.1f} | "
            f"{r['instr_before_first_w']} / {r['bar_before_first_w']} / {r['shfl_before_first_w']} / "
            f"{r['ldg_before_first_w']} | "
            f"{r['instructions']} | {r['instr_per_kb']:.1f} |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--which", default="all", choices=["all", "launcher", "loops"])
    p.add_argument("--dump", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--only", default=None, help="regex on the case name")
    a = p.parse_args()
    rows = []
    for c in cases(a.which):
        if a.only and not re.search(a.only, c[0]):
            continue
        print(f"compiling {c[0]} ...", file=sys.stderr, flush=True)
        rows.append(analyze(*c, dump=a.dump))
    print(f"triton {triton.__version__}, sm_90, {SMS} SMs; W = expert weights; in flight = peak outstanding "
          "weight LDGs (SASS dataflow) x bytes per LDG, x min(CTAs fit, programs per SM)\n")
    print(table(rows))
    print("\nMix per KB of weights (per thread):")
    for r in rows:
        print(f"- {r['name']}: {r['mix_per_kb']}")
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
