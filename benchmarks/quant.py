"""Quantized linear layers vs bf16, per layer of a model shape, measured in the same process (GPU).

For each linear layer shape (K in, N out) of Llama-3-8B (default) or Qwen3-0.6B and each row count, times
  bf16      the engine's unquantized path (the few-row Triton GEMV up to PAGEDLLM_GEMV_MAX_ROWS rows, else cuBLAS)
  int4      the tiled 4-bit path, group 128 (kernels/qgemv.py up to PAGEDLLM_QUANT_GEMV_MAX_ROWS rows, else
            kernels/qgemm.py): what 4-bit layers the mma layout cannot hold take (the mma path itself:
            benchmarks/qgemv_mma.py)
  int4-gemv / int4-gemm   each tiled kernel alone (the GEMV only up to 8 rows)
  int4-old  the general dequant kernel over the load-time layout (kernels/dequant_gemm.py: PAGEDLLM_QUANT_TILED=0)
  int8      the tiled path at 8 bits
  fp8       W8A8 FP8 as the engine runs it: per-token E4M3 activation quantization, then the Triton GEMM of
            kernels/w8a8_gemm.py up to FP8_TRITON_MAX_ROWS rows, torch._scaled_mm (row-wise scales) above
  fp8-triton / fp8-scaled-mm   the tiled Triton GEMM / cuBLAS alone at every row count; fp8-gemv the Triton GEMV
  w8a8      W8A8 INT8 (compressed-tensors int8 checkpoints): per-token int8 activations, the int8 tensor-core GEMM
            with the scales in its epilogue (kernels/quant_act.py + kernels/w8a8_gemm.py; its GEMV at 1 row)
  w8a8-tiles / w8a8-gemv   the tiled GEMM / the GEMV byte by byte alone at every row count; w8a8-words the GEMV
            on int32 words (dp4a, kernels/w8a8_gemm.GEMV_WORDS: the engine's up to W8A8_GEMV_WORDS_MAX_ROWS rows)
  w8a8-torch  the same in torch (quantize, torch._int_mm, scale): what ran before the kernels
Each cell is microseconds per call (CUDA-graph replays, cycling through enough weight copies that no weight is
served from L2), the weight bytes streamed per second (GB/s, packed weights + scales + zeros) and the speed-up
over bf16 at that row count (x). End-to-end numbers: benchmarks/latency.py and offline_throughput.py with the
configs in benchmarks/configs.

    PYTHONUNBUFFERED=1 python benchmarks/quant.py --model 8b --rows 1 2 4 8 16 64 256
    PYTHONUNBUFFERED=1 python benchmarks/quant.py --model 8b --sweep gemv --rows 1      # launch configs
    PYTHONUNBUFFERED=1 python benchmarks/quant.py --model 8b --sweep gemm --rows 16 --layers qkv down
    PYTHONUNBUFFERED=1 python benchmarks/quant.py --model 8b --sweep int8 --rows 64 256          # W8A8 INT8 GEMM configs
    PYTHONUNBUFFERED=1 python benchmarks/quant.py --model 8b --sweep fp8 --rows 1 16              # its FP8 form
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch

SHAPES = {
    "8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)},
    "0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)},
}
ROTATE_BYTES = 256 << 20  # weight copies per kind: at least this many bytes (H200 L2: 50 MB)


def time_us(fn, copies: int, reps: int = 3) -> float:
    """Median over `reps` replays of a CUDA graph holding max(20, copies) calls (fn(i) uses weight copy i)."""
    calls = max(20, copies)
    for i in range(min(calls, 2)):
        fn(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


class Layers:
    """Weight copies of one (K, N) shape in every format; `bytes[kind]` is what one call streams."""

    def __init__(self, k: int, n: int, kinds: list[str], device: str = "cuda") -> None:
        from pagedllm.kernels.qgemv import counters_for
        from pagedllm.layers.linear import RowParallelLinear
        from pagedllm.quantization.fp8 import quantize_weight_fp8_per_channel
        from pagedllm.quantization.tiled import to_tiled

        self.k, self.n, self.copies, self.bytes = k, n, {}, {}
        self.counters = counters_for(n, torch.device(device))
        for kind in kinds:
            if kind == "bf16":
                per = n * k * 2
            elif kind.startswith(("fp8", "w8a8")):
                per = n * k + n * 4
            else:
                bits = 8 if kind.startswith("int8") else 4
                per = k * n * bits // 8 + (k // 128) * n * 4
            count = max(1, math.ceil(ROTATE_BYTES / per))
            self.bytes[kind] = per
            copies = []
            for _ in range(count):
                if kind == "bf16":
                    with torch.device(device):
                        lin = RowParallelLinear(k, n, bias=False, params_dtype=torch.bfloat16)
                    lin.weight.data.normal_(0, 0.02)
                    copies.append(lin)
                elif kind.startswith("fp8"):
                    from pagedllm.kernels.w8a8_gemm import counters_for as w8a8_counters

                    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
                    copies.append((*quantize_weight_fp8_per_channel(w), w8a8_counters(n, torch.device(device))))
                elif kind.startswith("w8a8"):
                    from pagedllm.kernels.w8a8_gemm import counters_for as w8a8_counters

                    w = torch.randint(-128, 128, (n, k), device=device, dtype=torch.int8)
                    copies.append((w, torch.rand(n, device=device) * 1e-3, w8a8_counters(n, torch.device(device))))
                else:
                    bits = 8 if kind.startswith("int8") else 4
                    qweight = torch.randint(-2**31, 2**31 - 1, (k * bits // 32, n), device=device, dtype=torch.int32)
                    scales = torch.rand(k // 128, n, device=device, dtype=torch.bfloat16) * 0.01
                    zeros = torch.full((k // 128, n), 2 ** (bits - 1), device=device, dtype=torch.bfloat16)
                    if kind != "int4-old":
                        qweight, _ = to_tiled(qweight, bits, 128, zeros, None)
                    copies.append((qweight, scales, zeros, bits))
            self.copies[kind] = copies

    def call(self, kind: str, x: torch.Tensor, i: int, config=None):
        from pagedllm.kernels.dequant_gemm import dequant_matmul
        from pagedllm.kernels.qgemm import quant_gemm
        from pagedllm.kernels.qgemv import quant_gemv
        from pagedllm.quantization.kernels import fp8_linear

        layer = self.copies[kind][i]
        if kind == "bf16":
            return layer.linear_method.apply(layer, x)
        if kind == "fp8":  # as the engine: the Triton GEMM for a few rows, torch._scaled_mm above
            return fp8_linear(x, layer[0], layer[1], None, None, layer[2])
        if kind == "fp8-scaled-mm":
            return fp8_linear(x, layer[0], layer[1], backend="scaled_mm")
        if kind.startswith(("fp8-", "w8a8")) and kind != "w8a8-torch":  # the Triton kernels of w8a8_gemm.py
            from pagedllm.kernels.paged_attention import sm_count
            from pagedllm.kernels.quant_act import fp8_per_token, int8_per_token
            from pagedllm.kernels.w8a8_gemm import launch_config, w8a8_gemm

            x_q, x_scale = (fp8_per_token if kind.startswith("fp8") else int8_per_token)(x)
            if kind.endswith("-gemv"):
                config = dict(GEMV=True, WORDS=False)  # int8 byte by byte (FP8 has no other form)
            elif kind == "w8a8-words":
                config = dict(GEMV=True, WORDS=True)
            elif kind.endswith("-tiles") or (kind == "fp8-triton" and config is None):
                config = launch_config(x.shape[0], layer[0].shape[0], x.shape[1], sm_count(x.device),
                                       kind.startswith("fp8"))
            return w8a8_gemm(x_q, x_scale, layer[0], layer[1], None, x.dtype, layer[2], config)
        if kind == "w8a8-torch":
            from pagedllm.quantization.kernels import int8_w8a8_linear_torch

            return int8_w8a8_linear_torch(x, layer[0], layer[1])
        qweight, scales, zeros, bits = layer
        if kind == "int4-old":
            return dequant_matmul(x, qweight, scales, zeros, bits, 128)
        if kind in ("int4", "int8"):
            from pagedllm import envs
            gemv = x.shape[0] <= min(8, envs.PAGEDLLM_QUANT_GEMV_MAX_ROWS)
            kind = "int4-gemv" if gemv else "int4-gemm"
        kernel = quant_gemv if kind == "int4-gemv" else quant_gemm
        return kernel(x, qweight, scales, zeros, bits, 128, None, None, self.counters, config)


def compare(args) -> None:
    kinds = args.kinds
    print(f"{'layer':8} {'rows':>5} " + " ".join(f"{k:>22}" for k in kinds))
    print(f"{'':8} {'':>5} " + " ".join(f"{'us   GB/s     x':>22}" for _ in kinds))
    totals = {(r, k): 0.0 for r in args.rows for k in kinds}
    for name, (k, n) in SHAPES[args.model].items():
        if args.layers and name not in args.layers:
            continue
        layers = Layers(k, n, kinds)
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            times = {}
            for kind in kinds:
                if kind == "int4-gemv" and rows > 8:
                    continue
                times[kind] = time_us(lambda i: layers.call(kind, x, i), len(layers.copies[kind]))
                totals[(rows, kind)] += times[kind]
            bf16 = times.get("bf16")
            cells = []
            for kind in kinds:
                if kind not in times:
                    cells.append(f"{'-':>22}")
                    continue
                ratio = f"{bf16 / times[kind]:5.2f}x" if bf16 else ""
                cells.append(f"{times[kind]:8.1f} {layers.bytes[kind] / times[kind] / 1e3:6.0f} {ratio:>6}")
            print(f"{name:8} {rows:5d} " + " ".join(cells), flush=True)
    for rows in args.rows:
        have = [k for k in kinds if not (k == "int4-gemv" and rows > 8)]
        line = " ".join(f"{k}={totals[(rows, k)]:.1f}us" for k in have)
        speed = ""
        if "bf16" in have:
            speed = "; vs bf16 " + " ".join(f"{k}:{totals[(rows, 'bf16')] / totals[(rows, k)]:.2f}x"
                                            for k in have if k != "bf16")
        print(f"one layer (qkv+o+gate_up+down), {rows} rows: {line}{speed}")


def sweep(args) -> None:
    """Time launch configs of one tiled kernel per shape and row count; print each and the best."""
    if args.sweep == "gemv":
        kind = "int4-gemv"
        grid = lambda rows: [dict(block_n=bn, num_warps=w, rows=r, programs_per_sm=p, max_split=16)  # noqa: E731
                             for (bn, w), r, p in itertools.product([(128, 1), (256, 1), (256, 2), (512, 2), (512, 4)],
                                                                    [4, 8], [2, 4, 8])]
    elif args.sweep in ("int8", "fp8"):  # the W8A8 GEMM's tiles, warps, stages and K split (kernels/w8a8_gemm.py)
        kind = "w8a8" if args.sweep == "int8" else "fp8-triton"
        bms = lambda rows: [16] if rows <= 16 else [32, 64] if rows <= 64 else [64, 128]  # noqa: E731
        few = lambda rows: [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, SPLIT_K=sk)  # noqa: E731
                            for bm, bn, bk, w, st, sk in itertools.product(bms(rows), [64, 128], [128, 256], [4, 8],
                                                                          [3, 4], [1, 2, 4, 8])
                            if (sk == 1 or rows <= bm) and bm * bn * bk <= 128 * 128 * 128]
        # above 64 rows: no K split, wider tiles (128 x 256, 256 rows: each weight tile read once up to 256 rows)
        # and shallower K steps too
        many = lambda rows: [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, SPLIT_K=1)  # noqa: E731
                             for bm, bn, bk, w, st in itertools.product([64, 128, 256], [64, 128, 256], [64, 128],
                                                                        [4, 8], [3, 4])
                             if bm * bn <= 256 * 128 and bm <= max(64, rows)]
        grid = lambda rows: few(rows) if rows <= 64 else many(rows)  # noqa: E731
    else:
        kind = "int4-gemm"
        grid = lambda rows: [dict(block_m=bm, block_n=bn, num_warps=w, programs_per_sm=p, max_split=16)  # noqa: E731
                             for bm, (bn, w), p in itertools.product(
                                 [min(64, max(16, 1 << (rows - 1).bit_length()))] if rows <= 64 else [64, 128],
                                 [(32, 4), (64, 4), (128, 4), (128, 8)], [1, 2, 4])]
    for name, (k, n) in SHAPES[args.model].items():
        if args.layers and name not in args.layers:
            continue
        layers = Layers(k, n, [kind])
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            results = []
            for cfg in grid(rows):
                us = time_us(lambda i: layers.call(kind, x, i, cfg), len(layers.copies[kind]))
                results.append((us, cfg))
                print(f"  {name:8} rows={rows:<4} {us:8.1f} us {layers.bytes[kind] / us / 1e3:6.0f} GB/s  {cfg}",
                      flush=True)
            us, cfg = min(results, key=lambda r: r[0])
            print(f"best {name} rows={rows}: {us:.1f} us ({layers.bytes[kind] / us / 1e3:.0f} GB/s) {cfg}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="8b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--kinds", nargs="+", default=["bf16", "int4", "int4-gemv", "int4-gemm", "int4-old", "int8",
                                                  "fp8"])
    p.add_argument("--layers", nargs="+", help="only these layers (qkv o gate_up down)")
    p.add_argument("--sweep", choices=["gemv", "gemm", "int8", "fp8"],
                   help="time launch configs of one kernel instead (the tiled GEMV / GEMM, the W8A8 INT8 GEMM)")
    args = p.parse_args()
    if args.sweep:
        sweep(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
