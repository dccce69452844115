"""The split-KV decode attention kernel (kernels/paged_attention.py `_decode_kernel`) from its machine code, no GPU
needed: each variant is compiled ahead of time for sm_90 (H100 / H200) with Triton's own ptxas and the constants
`paged_decode_attention` would pass, and the tool prints, per variant,

- registers per thread, spill bytes (ptxas -v), shared memory per CTA;
- CTAs per SM that fit, by registers (65536 per SM, allocated per warp in 256-register units from each of the 4
  sub-partitions), by shared memory (228 KB per SM, 227 KB at most per CTA, 1 KB reserved per CTA) and by warps
  (64 per SM);
- the K/V buffers in shared memory (the pipeline's allocations in the compiled TTGIR, in tiles; none: the tile goes
  to registers, counted as one) and the KV bytes in flight per SM: CTAs x buffers x tile bytes (K + V of one
  BLOCK_N tile);
- the instruction mix of the main loop, per thread per tile and per KB of K + V: the loop body is the range of the
  largest backward branch of the SASS (cuobjdump -sass).

A markdown table on stdout; --json writes every number (with the whole opcode histogram of the loop). Variants are
the cartesian product of --cache x --reads (E4M3 only) x --block-n x --stages; --block-n / --stages default to the
launcher's decode_block_n / decode_num_stages. Reads of an E4M3 cache: fp16 (Q_FP16, the default), bf16 (widen to
the bf16 query's dtype), fp16-vw (Q_FP16 with V read as 32-bit words, V_WORDS).

    python benchmarks/kernel_sass.py --cache bf16 fp8 --block-n 64 128 --stages 3 --reads fp16 bf16 fp16-vw \\
        [--heads 16/8] [--head-size 128] [--block-size 16] [--warps 4] [--single-split] [--prep] [--json PATH]
        [--dump DIR]
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch
import triton

from pagedllm.kernels import paged_attention as pa

ARCH = 90  # H100 / H200
REGS_PER_SUBPARTITION = 16384  # 65536 per SM, 4 sub-partitions; a warp's registers come from one of them
REG_ALLOC_UNIT = 256  # registers per warp are allocated in these units
SMEM_PER_SM = 228 * 1024
SMEM_PER_CTA_MAX = 227 * 1024
SMEM_RESERVED_PER_CTA = 1024  # the CUDA runtime's shared memory per CTA on sm_80+
SMEM_ALLOC_UNIT = 128
WARPS_PER_SM = 64
CTAS_PER_SM = 32

# E4M3 reads: (Q_FP16, V_WORDS)
READS = {"fp16": (True, False), "bf16": (False, False), "fp16-vw": (True, True)}
CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
TRITON_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
              torch.float8_e4m3fn: "*fp8e4nv"}
QUERY_DTYPE = torch.bfloat16
SPLITS = 4  # the split-KV launch's (any count > 1 compiles the same; --single-split: 1)

# Main-loop columns: (name, opcode pattern). The first match counts; "(of which)" columns are subsets. The rest
# (LDGDEPBAR, the async copies' fence, floating-point math, moves, predicates) counts only in the total.
MIX = [("HMMA", r"HMMA"), ("LDSM", r"LDSM"), ("LDS", r"LDS(\.|$)"), ("STS/STSM", r"STS"), ("LDGSTS", r"LDGSTS"),
       ("LDG", r"LDG(\.|$)"), ("F2FP", r"F2FP"), ("F2F", r"F2F(\.|$)"), ("I2F", r"I2F"), ("PRMT", r"PRMT"),
       ("LOP3", r"LOP3"), ("SHF", r"SHF"), ("IMAD/IADD", r"(IMAD|IADD3|IADD|LEA|VIADD)"), ("MUFU.EX2", r"MUFU\.EX2"),
       ("BAR", r"BAR(\.|$)")]
SUBSETS = [("LDSM.T", "LDSM", r"LDSM\..*MT88"), ("LDS.U8", "LDS", r"LDS\.[US]8")]


@dataclass
class Variant:
    cache: str
    read: str  # "-" for a 16-bit cache
    block_n: int
    stages: int

    @property
    def name(self) -> str:
        read = "" if self.cache == "bf16" else f" {self.read}"
        return f"{self.cache}{read} N{self.block_n} s{self.stages}"


# ---------------------------------------------------------------------------------------------- tools


def nvidia_tools() -> dict[str, str]:
    """ptxas and cuobjdump of Triton's NVIDIA backend (the ptxas Triton itself runs for sm_90)."""
    from triton.backends import backends
    if "nvidia" not in backends:
        sys.exit("kernel_sass.py: this Triton has no NVIDIA backend, so it cannot compile for sm_90")
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    tools = {}
    for tool, names in (("ptxas", ("ptxas-blackwell", "ptxas")), ("cuobjdump", ("cuobjdump",))):
        found = [os.path.join(bindir, n) for n in names if os.access(os.path.join(bindir, n), os.X_OK)]
        if not found:
            sys.exit(f"kernel_sass.py: no {' / '.join(names)} in {bindir} (Triton's NVIDIA backend tools)")
        tools[tool] = found[0]
    return tools


# ---------------------------------------------------------------------------------------------- compile


def launcher_values(v: Variant, args) -> tuple[dict, dict]:
    """The constexprs paged_decode_attention passes for this variant, and the launch-time values of the integer
    arguments that Triton's JIT may specialize (strides of contiguous tensors, as the launcher's)."""
    num_heads, num_kv_heads = args.num_heads, args.num_kv_heads
    gqa = num_heads // num_kv_heads
    head_pad = triton.next_power_of_2(args.head_size)
    q_fp16, v_words = READS[v.read] if v.cache == "fp8" else (False, False)
    const = dict(GQA=gqa, GQA_PAD=max(16, triton.next_power_of_2(gqa)), BLOCK_N=v.block_n,
                 BLOCK_SIZE=args.block_size, HEAD_SIZE=args.head_size, HEAD_PAD=head_pad,
                 DOT_PRECISION=pa._dot_precision(QUERY_DTYPE), SINGLE_SPLIT=args.single_split, HAS_ORDER=False,
                 USE_PDL=False, SOFT_CAP=False, Q_FP16=q_fp16,
                 # the engine passes an E4M3 cache's v_scale (triton_backend.py)
                 OUT_SCALE=v.cache == "fp8", V_WORDS=v_words)
    if args.prep:  # the decode prep (DecodePrep): q_ptr is the qkv projection's output, Qwen3's q / k norms
        const.update(PREP=True, NUM_Q=num_heads, NUM_KV=num_kv_heads, HAS_NORM=True, FP32_PRODUCT=False)
    splits = 1 if args.single_split else SPLITS
    blocks, max_blocks = 4096, 64  # (only their divisibility by 16 can matter)
    d, bs = args.head_size, args.block_size
    ints = dict(stride_qt=(num_heads + 2 * num_kv_heads * args.prep) * d, stride_qh=d, stride_ot=num_heads * d, stride_oh=d,
                stride_c_kv=blocks * bs * num_kv_heads * d, stride_c_blk=bs * num_kv_heads * d,
                stride_c_slot=num_kv_heads * d, stride_c_head=d, stride_bt=max_blocks)
    if args.single_split:
        ints.update(stride_po_seq=0, stride_po_head=0, stride_po_split=0, stride_pl_seq=0, stride_pl_head=0)
    else:
        ints.update(stride_po_seq=num_heads * splits * head_pad, stride_po_head=splits * head_pad,
                    stride_po_split=head_pad, stride_pl_seq=num_heads * splits, stride_pl_head=splits)
    ints.update(num_splits=splits, window=pa.NO_WINDOW, stride_cs=d)
    return const, ints


def pointer_type(name: str, cache: torch.dtype, out_scale: bool) -> str:
    if name.startswith("cache"):
        return TRITON_PTR[cache]
    if name.startswith("part_"):
        return "*fp32"
    if name.startswith(("block_table", "seq_lens", "order")):
        return "*i32"
    if name.startswith(("positions", "slot")):
        return "*i64"
    if name.startswith("cos_sin"):
        return "*fp32"
    if name.startswith("out_scale"):
        return "*fp32" if out_scale else TRITON_PTR[QUERY_DTYPE]  # (the launcher's placeholder when unread)
    if name not in ("q_ptr", "out_ptr"):
        print(f"kernel_sass.py: new pointer argument {name}: typed as the query's dtype", file=sys.stderr)
    return TRITON_PTR[QUERY_DTYPE]


def signature(fn, v: Variant, args) -> tuple[dict, dict, dict]:
    """Triton signature, constexprs and divisibility attributes built from the kernel's own parameter list, so that
    a new argument needs at most a line here (a new constexpr with a default compiles at its default)."""
    const, ints = launcher_values(v, args)
    sig, constexprs, attrs = {}, {}, {}
    for p in fn.params:
        if p.is_constexpr:
            if p.name in const:
                constexprs[p.name] = const[p.name]
            elif p.has_default:
                constexprs[p.name] = p.default
            else:
                sys.exit(f"kernel_sass.py: the launcher's value of constexpr {p.name} is unknown: add it")
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = pointer_type(p.name, CACHES[v.cache], const["OUT_SCALE"])
            attrs[(p.num,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif "scale" in p.name or "cap" in p.name or p.name == "eps":
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32"
            if p.name not in ints:
                print(f"kernel_sass.py: new integer argument {p.name}: not specialized", file=sys.stderr)
            elif not p.do_not_specialize and ints[p.name] % 16 == 0:
                attrs[(p.num,)] = [["tt.divisibility", 16]]  # as the JIT specializes multiples of 16
    unused = set(const) - set(constexprs)
    if unused:
        sys.exit(f"kernel_sass.py: the kernel no longer takes {sorted(unused)}")
    return sig, constexprs, attrs


def compile_variant(v: Variant, args):
    fn = pa._decode_kernel
    sig, constexprs, attrs = signature(fn, v, args)
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    target = triton.backends.compiler.GPUTarget("cuda", ARCH, 32)
    try:
        # FP fusion on: Triton's default up to 3.9, which the launcher gets (it passes none)
        options = {"num_warps": args.warps, "num_stages": v.stages, "enable_fp_fusion": True}
        if args.maxnreg:
            options["maxnreg"] = args.maxnreg
        kernel = triton.compile(src, target=target, options=options)
    except Exception as e:  # noqa: BLE001 (say which variant failed, then re-raise)
        print(f"kernel_sass.py: compiling {v.name} for sm_{ARCH} failed: {e}", file=sys.stderr)
        raise
    return kernel, constexprs


# ---------------------------------------------------------------------------------------------- read the code


def ptxas_info(ptxas: str, ptx: str) -> dict:
    """Registers and spills of the PTX through ptxas -v (the options Triton compiles with)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name=sm_{ARCH}a", path,
                              "-o", os.path.join(tmp, "k.o")], capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return dict(regs=int(regs.group(1)) if regs else None, spill_stores=int(spill.group(1)) if spill else None,
                spill_loads=int(spill.group(2)) if spill else None)


def cubin_sass(cuobjdump: str, cubin: bytes) -> tuple[str, int]:
    """cuobjdump -sass of the cubin Triton built, and its registers per thread (-res-usage)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    return sass, int(re.search(r"REG:(\d+)", res).group(1))


def parse_sass(sass: str) -> list[tuple[int, str]]:
    """(address, instruction without its predicate) for each instruction of a cuobjdump -sass listing."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), re.sub(r"^@!?U?P[T\d]+\s+", "", m.group(2).strip())))
    return ins


def main_loop(ins: list[tuple[int, str]]) -> tuple[int, int]:
    """[target, branch] of the largest backward branch: the tile loop (Triton's pipeliner keeps one loop)."""
    best = None
    for addr, text in ins:
        m = re.match(r"BRA(?:\.\S+)?\s+(?:`\()?0x([0-9a-f]+)", text)
        if m:
            target = int(m.group(1), 16)
            if target < addr and (best is None or addr - target > best[1] - best[0]):
                best = (target, addr)
    if best is None:
        sys.exit("kernel_sass.py: no backward branch in the SASS (no loop found)")
    return best


def instruction_mix(ins: list[tuple[int, str]], lo: int, hi: int) -> tuple[dict, collections.Counter]:
    ops = [text.split()[0] for addr, text in ins if lo <= addr <= hi]
    mix = dict.fromkeys([name for name, _ in MIX] + [name for name, _, _ in SUBSETS], 0)
    for op in ops:
        for name, pat in MIX:
            if re.match(pat, op):
                mix[name] += 1
                break
        for name, _, pat in SUBSETS:
            if re.match(pat, op):
                mix[name] += 1
    mix["total"] = len(ops)
    return mix, collections.Counter(ops)


def kv_buffers(ttgir: str) -> int:
    """Bytes of the loop's K/V buffers in shared memory per CTA: the pipeliner's uninitialized mutable allocations
    of rank >= 3 (buffers x tile; the block-table rows it also buffers are rank 2)."""
    total = 0
    for m in re.finditer(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<((?:\d+x)+)([a-z]+)(\d+)\w*[^>]*mutable",
                         ttgir):
        dims = [int(x) for x in m.group(1).rstrip("x").split("x")]
        if len(dims) >= 3:
            n = 1
            for x in dims:
                n *= x
            total += n * int(m.group(3)) // 8
    return total


def ctas_per_sm(regs: int, smem: int, warps: int) -> dict:
    regs_per_warp = -(-regs * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = 4 * (REGS_PER_SUBPARTITION // regs_per_warp) // warps
    smem_cta = -(-smem // SMEM_ALLOC_UNIT) * SMEM_ALLOC_UNIT + SMEM_RESERVED_PER_CTA
    by_smem = SMEM_PER_SM // smem_cta if smem <= SMEM_PER_CTA_MAX else 0
    fit = min(by_regs, by_smem, WARPS_PER_SM // warps, CTAS_PER_SM)
    return dict(by_regs=by_regs, by_smem=by_smem, fit=fit)


def measure(v: Variant, args, tools: dict) -> dict:
    kernel, constexprs = compile_variant(v, args)
    sass, regs = cubin_sass(tools["cuobjdump"], kernel.asm["cubin"])
    info = ptxas_info(tools["ptxas"], kernel.asm["ptx"])
    if info["regs"] is not None and info["regs"] != regs:
        print(f"kernel_sass.py: {v.name}: ptxas -v says {info['regs']} registers, the cubin {regs}", file=sys.stderr)
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        base = os.path.join(args.dump, v.name.replace(" ", "_"))
        for ext in ("ttgir", "ptx"):
            with open(f"{base}.{ext}", "w") as f:
                f.write(kernel.asm[ext])
        with open(f"{base}.sass", "w") as f:
            f.write(sass)
    ins = parse_sass(sass)
    lo, hi = main_loop(ins)
    mix, ops = instruction_mix(ins, lo, hi)
    cache_bytes = CACHES[v.cache].itemsize
    tile = 2 * v.block_n * args.head_size * cache_bytes  # K + V of one tile
    # Per thread, one tile's two dots take 2 x (GQA_PAD/16) x (BLOCK_N x HEAD_PAD / 128) m16n8k16 HMMAs / warps.
    hmma = 2 * (constexprs["GQA_PAD"] // 16) * (v.block_n * constexprs["HEAD_PAD"] // 128) // args.warps
    if mix["HMMA"] != hmma:
        print(f"kernel_sass.py: {v.name}: {mix['HMMA']} HMMA in the loop body where one tile needs {hmma}: the "
              "per-tile numbers are per loop iteration", file=sys.stderr)
    buffered = kv_buffers(kernel.asm["ttgir"])
    # No buffer in shared memory: the tile goes to registers, still one tile in flight per CTA.
    buffers = buffered / tile if buffered else 1.0
    occ = ctas_per_sm(regs, kernel.metadata.shared, args.warps)
    kb = tile / 1024
    return dict(variant=v.name, cache=v.cache, read=v.read, block_n=v.block_n, stages=v.stages, warps=args.warps,
                constexprs=constexprs,
                regs=regs, spill_stores=info["spill_stores"], spill_loads=info["spill_loads"],
                shared=kernel.metadata.shared, ctas_per_sm=occ, tile_bytes=tile, kv_buffers=buffers,
                kv_buffers_in_smem=bool(buffered), kv_in_flight_per_sm=occ["fit"] * buffers * tile,
                loop=[hex(lo), hex(hi)], per_tile=mix, per_kb={k: c / kb for k, c in mix.items()},
                loop_opcodes=dict(ops.most_common()))


# ---------------------------------------------------------------------------------------------- output


def num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,.1f}"


def tables(rows: list[dict]) -> str:
    out = ["| variant | registers | spills (st/ld B) | shared | CTAs / SM (regs / smem / fit) | K/V buffers "
           "| KV in flight / SM | instructions / tile | / KB |", "|" + "---|" * 9]
    for r in rows:
        occ = r["ctas_per_sm"]
        buffers = num(r["kv_buffers"]) + ("" if r["kv_buffers_in_smem"] else " (registers)")
        out.append(f"| {r['variant']} | {r['regs']} | {r['spill_stores']}/{r['spill_loads']} "
                   f"| {r['shared'] / 1024:.1f} KB | {occ['by_regs']} / {occ['by_smem']} / **{occ['fit']}** "
                   f"| {buffers} | {num(r['kv_in_flight_per_sm'] / 1024)} KB | {num(r['per_tile']['total'])} "
                   f"| {r['per_kb']['total']:.1f} |")
    cols = [name for name, _ in MIX] + ["total"]
    sub = {parent: name for name, parent, _ in SUBSETS}
    heads = [f"{c} ({sub[c][len(c):]})" if c in sub else c for c in cols]
    for title, key, fmt in (("per thread per tile", "per_tile", num), ("per KB of K + V", "per_kb",
                                                                       lambda x: f"{x:.1f}")):
        out += ["", f"Main loop, instructions {title} (in parentheses: of which LDSM.T / LDS.U8):", "",
                "| variant | " + " | ".join(heads) + " |", "|" + "---|" * (len(cols) + 1)]
        for r in rows:
            m = r[key]
            cells = [fmt(m[c]) + (f" ({fmt(m[sub[c]])})" if c in sub and m[sub[c]] else "") for c in cols]
            out.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", nargs="+", choices=list(CACHES), default=["bf16", "fp8"])
    p.add_argument("--reads", nargs="+", choices=list(READS), default=["fp16"], help="E4M3 cache reads")
    p.add_argument("--block-n", nargs="+", type=int, default=None, help="default: decode_block_n")
    p.add_argument("--stages", nargs="+", type=int, default=None, help="default: decode_num_stages")
    p.add_argument("--heads", default="16/8", help="query heads / kv heads (Qwen3-0.6B's)")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="cache block size")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--maxnreg", type=int, default=None,
                   help="cap the registers per thread (Triton's maxnreg launch option): spills vs CTAs per SM")
    p.add_argument("--single-split", action="store_true", help="SINGLE_SPLIT (one program per request and head)")
    p.add_argument("--prep", action="store_true", help="PREP: qkv_prep's work inside the kernel (DecodePrep)")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--dump", default=None, help="keep each variant's TTGIR, PTX and SASS in this folder")
    args = p.parse_args()
    args.num_heads, args.num_kv_heads = (int(x) for x in args.heads.split("/"))
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("kernel_sass.py: unset TRITON_INTERPRET (the kernel compiles differently in the interpreter)")
    tools = nvidia_tools()
    splits = 1 if args.single_split else SPLITS
    variants = []
    for cache in args.cache:
        dtype = CACHES[cache]
        block_ns = args.block_n or [pa.decode_block_n(QUERY_DTYPE, args.head_size, splits, cache_dtype=dtype)]
        stages = args.stages or [pa.decode_num_stages(dtype, splits)]
        reads = args.reads if cache == "fp8" else ["-"]
        variants += [Variant(cache, r, n, s) for r, n, s in itertools.product(reads, block_ns, stages)]
    rows = []
    for v in variants:
        print(f"compiling {v.name} ...", file=sys.stderr, flush=True)
        rows.append(measure(v, args, tools))
    print(f"_decode_kernel for sm_{ARCH}: heads {args.heads}, head size {args.head_size}, block size "
          f"{args.block_size}, {args.warps} warps, {'one split' if args.single_split else 'split-KV'}"
          f"{f', maxnreg {args.maxnreg}' if args.maxnreg else ''}{', decode prep' if args.prep else ''}; "
          f"triton {triton.__version__}\n")
    print(tables(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(arch=ARCH, triton=triton.__version__, args={k: x for k, x in vars(args).items()},
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
