"""Quantized linear layers vs bf16, per layer of a model shape, measured in the same process (GPU).

For each linear layer shape (K in, N out) of Llama-3-8B (default) or Qwen3-0.6B and each row count, times
  bf16   the engine's unquantized path (the few-row Triton GEMV up to PAGEDLLM_GEMV_MAX_ROWS rows, else cuBLAS)
  int4   kernels/dequant_gemm.py over the 4-bit GPTQ/AWQ layout, group 128
  int8   the same kernel, 8-bit
  fp8    W8A8: per-token E4M3 activation quantization + torch._scaled_mm with row-wise scales
and prints microseconds per call (CUDA-graph replays of 20 calls, so launch gaps do not count) and the weight
bytes streamed per microsecond (GB/s). End-to-end numbers come from benchmarks/latency.py and
benchmarks/offline_throughput.py with --quantization / --kv-cache-dtype and the configs in benchmarks/configs.

    PYTHONUNBUFFERED=1 python benchmarks/quant.py --model 8b --rows 1 64
"""
from __future__ import annotations

import argparse

import torch

SHAPES = {
    "8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)},
    "0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)},
}


def time_us(fn, reps: int = 20, graphs: int = 5) -> float:
    """Median over `graphs` replays of a CUDA graph holding `reps` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(graphs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def make_layers(k: int, n: int, device: str):
    from pagedllm.quantization.fp8 import quantize_weight_fp8_per_channel

    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    layers = {"bf16": (w, w.numel() * 2)}
    for bits in (4, 8):
        pack, groups = 32 // bits, k // 128
        qweight = torch.randint(-2**31, 2**31 - 1, (k // pack, n), device=device, dtype=torch.int32)
        scales = torch.rand(groups, n, device=device, dtype=torch.bfloat16) * 0.01
        zeros = torch.full((groups, n), 2 ** (bits - 1), device=device, dtype=torch.bfloat16)
        layers[f"int{bits}"] = ((qweight, scales, zeros, bits), qweight.numel() * 4 + scales.numel() * 4)
    wq, ws = quantize_weight_fp8_per_channel(w)
    layers["fp8"] = ((wq, ws), wq.numel())
    return layers


def call(kind: str, x: torch.Tensor, layer, linear_module):
    from pagedllm.kernels.dequant_gemm import dequant_matmul
    from pagedllm.quantization.kernels import fp8_linear

    if kind == "bf16":
        return linear_module.linear_method.apply(linear_module, x)
    if kind == "fp8":
        return fp8_linear(x, *layer)
    qweight, scales, zeros, bits = layer
    return dequant_matmul(x, qweight, scales, zeros, bits, 128)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="8b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    p.add_argument("--kinds", nargs="+", default=["bf16", "int4", "int8", "fp8"])
    args = p.parse_args()
    from pagedllm.layers.linear import RowParallelLinear

    device = "cuda"
    print(f"{'layer':8} {'rows':>5} " + " ".join(f"{k + ' us':>10} {'GB/s':>6}" for k in args.kinds))
    totals = {(r, k): 0.0 for r in args.rows for k in args.kinds}
    for name, (k, n) in SHAPES[args.model].items():
        layers = make_layers(k, n, device)
        with torch.device(device):
            linear = RowParallelLinear(k, n, bias=False, params_dtype=torch.bfloat16)
        linear.weight.data.copy_(layers["bf16"][0])
        for rows in args.rows:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            cells = []
            for kind in args.kinds:
                layer, nbytes = layers[kind]
                us = time_us(lambda: call(kind, x, layer, linear))
                totals[(rows, kind)] += us
                cells.append(f"{us:10.1f} {nbytes / us / 1e3:6.0f}")
            print(f"{name:8} {rows:5d} " + " ".join(cells))
    for rows in args.rows:
        line = " ".join(f"{k}={totals[(rows, k)]:.1f}us" for k in args.kinds)
        bf16 = totals[(rows, "bf16")]
        speed = " ".join(f"{k}:{bf16 / totals[(rows, k)]:.2f}x" for k in args.kinds if k != "bf16")
        print(f"one layer (qkv+o+gate_up+down), {rows} rows: {line}; vs bf16 {speed}")


if __name__ == "__main__":
    main()
