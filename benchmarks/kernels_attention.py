"""Microbenchmark: Triton paged attention at the Llama-3-8B head config (32 q heads, 8 kv heads, head 128, bf16).

Decode: split-KV kernel (+ reduce), timed under CUDA-graph replay (as the engine runs decode), for batch
1..256 x context 1k..32k, reporting achieved GB/s of K/V read against the H200's ~4.3 TB/s copy rate,
with torch SDPA over *contiguous* K/V (enable_gqa) as the peer where it fits.
Prefill: the mixed kernel on fresh prompts and on chunks with cached prefixes, in TFLOP/s (causal FLOPs),
with torch SDPA (causal, contiguous) as the peer for fresh prompts.

    PYTHONPATH=src python3 benchmarks/kernels_attention.py [--sweep] [--quick] [--spread]
    PYTHONPATH=src python3 benchmarks/kernels_attention.py --gqa-sweep 32/4 --batches 64 256 512 --ctx 530
    PYTHONPATH=src python3 benchmarks/kernels_attention.py --gqa-sweep 16/8 --batches 256 --ctx 768 --kv-dtype fp8
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

from pagedllm.attention.triton_backend import TritonAttentionBackend
from pagedllm.kernels.paged_attention import decode_num_splits, paged_decode_attention, paged_prefill_attention

H, KVH, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
PEAK_GBS = 4300.0
DEV = torch.device("cuda")


def _graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


class DecodeBench:
    def __init__(self, max_tokens: int):
        self.num_blocks = max_tokens // BS + 1
        self.cache = torch.empty(2, self.num_blocks, BS, KVH, D, dtype=DTYPE, device=DEV).normal_()
        self.backend = TritonAttentionBackend()
        self.workspace = self.backend.reserve_workspace(H, KVH, D, DEV)

    def setup(self, batch: int, ctx: int):
        nblk = triton.cdiv(ctx, BS)
        perm = torch.randperm(self.num_blocks - 1, device=DEV)[: batch * nblk] + 1
        block_table = perm.view(batch, nblk).to(torch.int32)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        q = torch.randn(batch, H, D, device=DEV, dtype=DTYPE)
        out = torch.empty_like(q)
        return q, block_table, seq_lens, out

    def run(self, batch: int, ctx: int, **kw) -> float:
        q, block_table, seq_lens, out = self.setup(batch, ctx)
        ws = self.workspace
        splits = kw.get("num_splits")
        if splits is not None and batch * H * splits * D > ws[0].numel():
            ws = (torch.empty(batch * H * splits * D, device=DEV), torch.empty(batch * H * splits, device=DEV))

        def fn():
            paged_decode_attention(q, self.cache, block_table, seq_lens, D ** -0.5, num_seqs=batch, output=out,
                                   workspace=ws, **kw)
        return _graph_ms(fn)


def kv_bytes(batch: int, ctx: int) -> int:
    return batch * ctx * KVH * D * 2 * 2  # K and V, 2 bytes each


def sdpa_decode_ms(batch: int, ctx: int) -> float:
    q = torch.randn(batch, H, 1, D, device=DEV, dtype=DTYPE)
    k = torch.randn(batch, KVH, ctx, D, device=DEV, dtype=DTYPE)
    v = torch.randn_like(k)
    ms = _graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    del q, k, v
    return ms


def decode_table(batches, ctxs, max_tokens, peer_max_tokens=1 << 20):
    bench = DecodeBench(max_tokens)
    print("\n## Decode (paged, split-KV, CUDA-graph replay), Llama-3-8B heads, bf16, block 16")
    print("(rows marked * read less K/V than the 60 MB L2, so repeated replays partly hit L2)")
    print("| batch | context | splits | time (us) | KV GB/s | % of 4.3 TB/s | SDPA contiguous (us) | SDPA GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        for c in ctxs:
            if b * c > max_tokens:
                continue
            ms = bench.run(b, c)
            gbs = kv_bytes(b, c) / ms / 1e6
            peer = ""
            if b * c <= peer_max_tokens:
                pms = sdpa_decode_ms(b, c)
                peer = f"{pms * 1e3:.1f} | {kv_bytes(b, c) / pms / 1e6:.0f}"
            else:
                peer = "- | -"
            splits = decode_num_splits(b, KVH, DEV)
            mark = "*" if kv_bytes(b, c) < 60e6 else ""
            print(f"| {b} | {c}{mark} | {splits} | {ms * 1e3:.1f} | {gbs:.0f} | {100 * gbs / PEAK_GBS:.0f}% | {peer} |",
                  flush=True)
    return bench


def causal_flops(specs) -> float:
    total = 0
    for cached, qlen in specs:
        total += qlen * cached + qlen * (qlen + 1) // 2
    return 4.0 * H * D * total


def prefill_setup(specs):
    from attention_cases import build_batch  # tests/gpu helper
    return build_batch(specs, H, KVH, D, BS, DTYPE, "cuda", poison=False)


def prefill_ms(batch, **kw) -> float:
    md = batch.metadata
    out = torch.empty(batch.query.shape, dtype=DTYPE, device=DEV)

    def fn():
        paged_prefill_attention(batch.query, batch.kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                batch.scale, num_seqs=md.num_reqs, max_query_len=md.max_query_len, output=out, **kw)
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def sdpa_prefill_ms(num_seqs: int, qlen: int) -> float:
    q = torch.randn(num_seqs, H, qlen, D, device=DEV, dtype=DTYPE)
    k = torch.randn(num_seqs, KVH, qlen, D, device=DEV, dtype=DTYPE)
    v = torch.randn_like(k)
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    fn()
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


PREFILL_CASES = [
    ("8 x 1024 fresh", [(0, 1024)] * 8),
    ("1 x 8192 fresh", [(0, 8192)]),
    ("4 x 2048 after 6144 cached", [(6144, 2048)] * 4),
    ("16 x 512 chunks after 3584 cached", [(3584, 512)] * 16),
]


def prefill_table():
    print("\n## Prefill / mixed kernel (paged), Llama-3-8B heads, bf16, block 16 (causal FLOPs)")
    print("| case | tokens | time (ms) | TFLOP/s | SDPA contiguous (ms) | SDPA TFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, specs in PREFILL_CASES:
        batch = prefill_setup(specs)
        ms = prefill_ms(batch)
        tflops = causal_flops(specs) / ms / 1e9
        peer = "- | -"
        if all(c == 0 for c, _ in specs) and len(set(q for _, q in specs)) == 1:
            pms = sdpa_prefill_ms(len(specs), specs[0][1])
            peer = f"{pms:.3f} | {causal_flops(specs) / pms / 1e9:.0f}"
        print(f"| {name} | {sum(q for _, q in specs)} | {ms:.3f} | {tflops:.0f} | {peer} |", flush=True)
        del batch


def sweep(bench: DecodeBench):
    print("\n## Sweep: decode num_stages (default block_n 64, 4 warps, default splits) -> us")
    cases = [(1, 32768), (8, 8192), (16, 8192), (32, 4096), (64, 4096), (256, 1024), (256, 4096)]
    print("| stages | " + " | ".join(f"b{b} c{c} (s{decode_num_splits(b, KVH, DEV)})" for b, c in cases) + " |")
    for st in (2, 3, 4):
        row = [f"{bench.run(b, c, num_stages=st) * 1e3:.1f}" for b, c in cases]
        print(f"| {st} | " + " | ".join(row) + " |", flush=True)

    print("\n## Sweep: prefill (block_m, block_n, num_warps, num_stages) -> ms")
    variants = [(None, None, None, None), (128, 128, 8, 3), (128, 32, 4, 3), (128, 64, 8, 3)]
    cases = [PREFILL_CASES[0], PREFILL_CASES[1], PREFILL_CASES[2]]
    batches = [prefill_setup(specs) for _, specs in cases]
    for bm, bn, w, st in variants:
        row = []
        for (name, specs), batch in zip(cases, batches):
            try:
                ms = prefill_ms(batch, block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                row.append(f"{ms:.3f} ms ({causal_flops(specs) / ms / 1e9:.0f} TF)")
            except Exception as e:  # noqa: BLE001
                row.append(f"ERR {type(e).__name__}")
        label = "default" if bm is None else f"bm{bm} bn{bn} w{w} s{st}"
        print(f"{label}: " + " | ".join(row), flush=True)


def spread_table(num_heads: int = 16, num_kv_heads: int = 8) -> None:
    """Decode with contexts spread over ~1000 tokens (as in a running batch), Qwen3-0.6B heads by default: every
    split count, both K/V tile sizes, with and without the longest-first start order (`--spread`)."""
    import random

    max_tokens = 400_000
    num_blocks = max_tokens // BS + 1
    cache = torch.empty(2, num_blocks, BS, num_kv_heads, D, dtype=DTYPE, device=DEV).normal_()
    ws = (torch.empty(300 * num_heads * 64 * D, device=DEV), torch.empty(300 * num_heads * 64, device=DEV))
    print(f"\n## Decode, contexts spread, {num_heads} q / {num_kv_heads} kv heads (* = the engine's split count)")
    print("| batch | contexts | splits | block_n | longest first | time (us) | KV GB/s | % of 4.3 TB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, lo, hi in [(8, 1000, 2000), (32, 900, 2000), (48, 800, 1900), (64, 800, 1800), (96, 700, 1700),
                          (128, 600, 1600), (192, 400, 1400), (256, 300, 1300)]:
        rng = random.Random(0)
        lens = [rng.randint(lo, hi) for _ in range(batch)]
        nblk = triton.cdiv(max(lens), BS)
        block_table = (torch.randperm(num_blocks - 1, device=DEV)[: batch * nblk] + 1).view(batch, nblk).to(torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        order = torch.argsort(-seq_lens, stable=True).to(torch.int32)
        q = torch.randn(batch, num_heads, D, device=DEV, dtype=DTYPE)
        out = torch.empty_like(q)
        kv = sum(lens) * num_kv_heads * D * 4
        auto = decode_num_splits(batch, num_kv_heads, DEV, 64, hi)
        for splits in sorted({1, 2, 4, 8, 16, auto}):
            if batch * num_kv_heads * splits > 32 * 132:
                continue
            for block_n in (32, 64):
                for ordered in (False, True):
                    ms = _graph_ms(lambda: paged_decode_attention(
                        q, cache, block_table, seq_lens, D ** -0.5, num_seqs=batch, output=out, workspace=ws,
                        num_splits=splits, block_n=block_n, order=order if ordered else None))
                    gbs = kv / ms / 1e6
                    print(f"| {batch} | {lo}-{hi} | {splits}{'*' if splits == auto else ''} | {block_n} | "
                          f"{'yes' if ordered else 'no'} | {ms * 1e3:.1f} | {gbs:.0f} | {100 * gbs / PEAK_GBS:.0f}% |",
                          flush=True)


def few_rows_table(batches: list[int], ctxs: list[int]) -> None:
    """Decode at a few requests with short contexts (a chat at batch 1): every split count and both K/V tile widths,
    8B heads, each time the split kernel plus its reduce (`--few-rows`)."""
    bench = DecodeBench(max(batches) * max(ctxs) + BS)
    print(f"\n## Decode, few requests, short contexts, {H} q / {KVH} kv heads (us; * = the engine's choice)")
    print("| batch | context | splits | block_n | time (us) | KV GB/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    from pagedllm.kernels.paged_attention import decode_block_n

    for batch in batches:
        for ctx in ctxs:
            auto = decode_num_splits(batch, KVH, DEV, 64, ctx)
            auto_bn = decode_block_n(DTYPE, D, auto, ctx)
            for splits in sorted({1, 2, 4, 8, 16, auto}):
                if batch * KVH * splits > 8 * 132:
                    continue
                for block_n in (32, 64):
                    ms = bench.run(batch, ctx, num_splits=splits, block_n=block_n)
                    star = "*" if (splits, block_n) == (auto, auto_bn) else ""
                    print(f"| {batch} | {ctx} | {splits} | {block_n} | {ms * 1e3:.1f}{star} | "
                          f"{kv_bytes(batch, ctx) / ms / 1e6:.0f} |", flush=True)


def gqa_sweep(heads: str, batches: list[int], ctx: int, kv_dtype: str = "auto", quick: bool = False,
              fp8_reads: tuple[str, ...] = ("default",), tiles=None, stages=None) -> None:
    """Decode at one head layout (`--gqa-sweep 32/4`: Qwen3-30B-A3B's 8 query heads per kv head) and batch sizes of
    a throughput run, every context ctx +- 5%: tile width x pipeline stages x warps x splits, against the default
    the engine picks (`decode_num_splits`, `decode_block_n`, 4 warps, 3 stages). `--kv-dtype fp8`: an E4M3 cache
    (the kernels widen what they load), with 128-position tiles and 5 stages tried too; `--fp8-read fp16 bf16
    fp16-vw` sweeps each way the kernels may read it (paged_attention.FP8_KV_COMPUTE / FP8_V_WORDS). `--tiles` /
    `--stages`: only those. `--quick`: 4 warps only."""
    from pagedllm.kernels import paged_attention

    for read in fp8_reads:
        if read != "default":
            paged_attention.FP8_KV_COMPUTE = read.split("-")[0]
            paged_attention.FP8_V_WORDS = read.endswith("-vw")
        _gqa_sweep_one(heads, batches, ctx, kv_dtype, quick, read, tiles, stages)


def _gqa_sweep_one(heads: str, batches: list[int], ctx: int, kv_dtype: str, quick: bool, read: str,
                   tiles=None, stages=None) -> None:
    import itertools
    import random

    from pagedllm.kernels.paged_attention import decode_block_n, decode_num_stages

    num_heads, num_kv_heads = (int(v) for v in heads.split("/"))
    max_tokens = max(batches) * int(ctx * 1.05 + BS)
    num_blocks = max_tokens // BS + 1
    cache = torch.empty(2, num_blocks, BS, num_kv_heads, D, dtype=DTYPE, device=DEV).normal_()
    fp8 = kv_dtype == "fp8"
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
    elem = cache.element_size()
    print(f"\n## Decode sweep, {num_heads} q / {num_kv_heads} kv heads, {cache.dtype} cache, contexts {ctx} +- 5% "
          f"(us; * = default{'' if read == 'default' else '; read as ' + read})")
    print("| batch | splits | block_n | warps | stages | time (us) | KV GB/s | % of 4.3 TB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in batches:
        rng = random.Random(batch)
        lens = [rng.randint(int(ctx * 0.95), int(ctx * 1.05)) for _ in range(batch)]
        nblk = triton.cdiv(max(lens), BS)
        perm = torch.randperm(num_blocks - 1, device=DEV)[: batch * nblk] + 1
        block_table = perm.view(batch, nblk).to(torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        q = torch.randn(batch, num_heads, D, device=DEV, dtype=DTYPE)
        out = torch.empty_like(q)
        kv = sum(lens) * num_kv_heads * D * 2 * elem
        auto_splits = decode_num_splits(batch, num_kv_heads, DEV, 64, max(lens), cache.dtype)
        auto_bn = decode_block_n(DTYPE, D, auto_splits, max(lens), cache.dtype)
        auto_stages = decode_num_stages(cache.dtype, auto_splits)
        ws = (torch.empty(batch * num_heads * 8 * D, device=DEV), torch.empty(batch * num_heads * 8, device=DEV))
        tile_widths = tiles or ((32, 64, 128) if fp8 else (32, 64))
        warp_counts = (4,) if quick else (4, 8)
        stage_counts = stages or ((1, 2, 3, 5) if fp8 else (1, 2, 3))  # 5: the first count with two buffers per tile
        for splits, block_n, warps, n_stages in itertools.product(sorted({1, 2, 4, auto_splits}), tile_widths,
                                                                   warp_counts, stage_counts):
            if splits > 8:
                continue
            try:
                ms = _graph_ms(lambda: paged_decode_attention(
                    q, cache, block_table, seq_lens, D ** -0.5, num_seqs=batch, output=out, workspace=ws,
                    num_splits=splits, block_n=block_n, num_warps=warps, num_stages=n_stages))
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit
                print(f"| {batch} | {splits} | {block_n} | {warps} | {n_stages} | {type(e).__name__} | | |", flush=True)
                continue
            gbs = kv / ms / 1e6
            star = "*" if (splits, block_n, warps, n_stages) == (auto_splits, auto_bn, 4, auto_stages) else ""
            print(f"| {batch} | {splits} | {block_n} | {warps} | {n_stages} | {ms * 1e3:.1f}{star} | {gbs:.0f} | "
                  f"{100 * gbs / PEAK_GBS:.0f}% |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gqa-sweep", metavar="Q/KV", default=None,
                    help="only the decode sweep at this head layout, e.g. 32/4 (with --batches, --ctx)")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--ctx", type=int, default=530)
    ap.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto", help="the cache of --gqa-sweep")
    ap.add_argument("--fp8-read", nargs="+", default=["default"],
                    choices=["default", "fp16", "bf16", "fp16-vw"],
                    help="--gqa-sweep --kv-dtype fp8: how the kernels read the E4M3 cache (each in turn)")
    ap.add_argument("--tiles", type=int, nargs="+", default=None, help="--gqa-sweep: these tile widths only")
    ap.add_argument("--stages", type=int, nargs="+", default=None, help="--gqa-sweep: these stage counts only")
    ap.add_argument("--sweep", action="store_true", help="also run the tuning sweeps")
    ap.add_argument("--quick", action="store_true", help="fewer decode points")
    ap.add_argument("--few-rows", action="store_true",
                    help="only the few-requests short-context decode table (with --batches, --ctxs)")
    ap.add_argument("--ctxs", type=int, nargs="+", default=[128, 384, 1024, 2048])
    ap.add_argument("--spread", action="store_true", help="only the spread-context decode table (Qwen3-0.6B heads)")
    args = ap.parse_args()
    if args.fp8_read != ["default"] and not (args.gqa_sweep and args.kv_dtype == "fp8"):
        ap.error("--fp8-read applies to --gqa-sweep with --kv-dtype fp8 (the ways an E4M3 cache is read)")
    if args.gqa_sweep:
        gqa_sweep(args.gqa_sweep, args.batches, args.ctx, args.kv_dtype, args.quick, tuple(args.fp8_read),
                  args.tiles, args.stages)
        return
    if args.few_rows:
        few_rows_table(args.batches, args.ctxs)
        return
    if args.spread:
        spread_table()
        return
    sys.path.insert(0, "tests/gpu")
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}")
    batches = [1, 8, 32, 64, 128, 256] if not args.quick else [1, 32, 256]
    ctxs = [1024, 4096, 16384, 32768] if not args.quick else [1024, 32768]
    max_tokens = 256 * 32768 if not args.quick else 32 * 32768
    bench = decode_table(batches, ctxs, max_tokens)
    prefill_table()
    if args.sweep:
        sweep(bench)


if __name__ == "__main__":
    main()
