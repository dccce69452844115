"""Few-row bf16 / fp16 GEMV on the tensor cores over the plain [N, K] weight (CUDA C++ in csrc/gemv_mma.cu, compiled
at first use with NVRTC through torch), with an optional fused SiLU-and-mul.

Why: a verify step (1 + k rows), a small decode batch or a LoRA step's base product has 2-32 rows. The Triton GEMV
(kernels/gemv.py) multiplies on the CUDA cores, one pass of multiply-adds per row, and loses to cuBLAS past a few
rows; cuBLAS at 2-32 rows streams the weight well below the bandwidth a one-row GEMV reaches. Here the rows are the
B columns of mma.m16n8k16 (swap-AB, as kernels/qgemv_mma.py for int4 weights): 1 to 8 rows cost one pass over the
weight, 9 to 32 two or four row tiles of the same pass. The weight needs no repacking (row-major, rows 16-byte aligned).

Numerics: products exact, sums fp32 in another order than cuBLAS's, rounded once to the output dtype; the gated
path rounds gate and up, then the activation, then the product, as `silu_and_mul` after a linear layer does
(`kernels.gemv.gemv_ref`).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

# kernel_available: the int4 kernel's conditions hold here too (mma.m16n8k16 on bf16 needs compute capability 8.0;
# NVRTC through torch.cuda._compile_kernel)
from pagedllm.kernels.qgemv_mma import _launch_pdl, cuda_source, kernel_available  # noqa: F401

CHUNK = 64  # channels per chunk: four MMAs
MAX_ROWS = 32  # four row tiles of 8
ROW_TILES = (1, 2, 4)
# warps None: by the grid (`default_warps`); depth: units of a warp in flight; unit: chunks per unit (at most this,
# dividing the chunks); ct: column tiles per block sharing each x fragment (not gated)
CONFIG = {"warps": None, "unit": 1, "depth": 2, "ct": 1}


# Per (gated, row tiles) overrides of the above: plain products of 1-16 rows read two chunks per unit with 8 warps
# per block (the 8B / Qwen3-0.6B layer chains at 1-16 rows, docs/benchmarks.md "The tensor-core few-row GEMV").
ROW_TILE_CONFIG = {(False, 1): {"unit": 2, "warps": 8}, (False, 2): {"unit": 2, "warps": 8}}


def base_config(gated: bool, mt: int = 1) -> dict:
    return {**CONFIG, **ROW_TILE_CONFIG.get((gated, mt), {})}


def layout_problem(weight: torch.Tensor, gated: bool = False) -> Optional[str]:
    """Why the kernel cannot read this weight (None: it can)."""
    if weight.dim() != 2 or weight.dtype not in (torch.float16, torch.bfloat16):
        return "needs a 2-D fp16 / bf16 weight"
    n, k = weight.shape
    if weight.stride(1) != 1 or weight.stride(0) % 8 or weight.data_ptr() % 16:
        return "needs rows of contiguous, 16-byte aligned channels"
    if k % CHUNK:
        return f"needs K % {CHUNK} == 0 (K={k})"
    if n % (32 if gated else 16):
        return f"needs N % 16 == 0 per output (N={n}{', gated' if gated else ''})"
    return None


def _warps(warps: int, tiles: int, mt: int) -> int:
    return max(1, min(warps, 64 // (tiles * mt)))  # the reduction's shared memory: warps * tiles * mt * 512 bytes


def default_warps(blocks: int) -> int:
    """Warps per block (they split K): about 2048 warps in all, 4 to 16 per block: one wave on an H200 (at 72-158
    registers a multiprocessor holds ~12-26 warps), each warp keeping DEPTH 2 KB chunk loads in flight."""
    warps = 16
    while warps > 4 and blocks * warps > 2048:
        warps //= 2
    return warps


def _unit(unit: int, chunks: int) -> int:
    while chunks % unit:
        unit //= 2
    return max(1, unit)


@functools.lru_cache(maxsize=None)
def _compile(warps: int, unit: int, depth: int, mt: int, ct: int, gated: bool, fp16: bool, has_bias: bool,
             device_index: int):
    major, minor = torch.cuda.get_device_capability(device_index)
    defines = (f"#define WARPS {warps}\n#define UNIT {unit}\n#define DEPTH {depth}\n#define MT {mt}\n#define CT {ct}\n"
               f"#define GATED {int(gated)}\n#define IS_FP16 {int(fp16)}\n#define HAS_BIAS {int(has_bias)}\n")
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(defines + cuda_source("gemv_mma.cu"), "gemv_mma",
                                          compute_capability=f"{major}{minor}")


def _launch_shape(n_out: int, k: int, gated: bool, mt: int, cfg: dict) -> tuple:
    """(warps, unit, column tiles per block, blocks along N) of one call."""
    ct = 2 if gated else cfg["ct"]
    tiles = n_out // 16
    if not gated:
        while tiles % ct:
            ct //= 2
    blocks = tiles if gated else tiles // ct
    warps = _warps(cfg["warps"] or default_warps(blocks), 2 if gated else ct, mt)
    return warps, _unit(cfg["unit"], k // CHUNK), ct, blocks


@functools.lru_cache(maxsize=None)
def _prepare(n_out: int, k: int, gated: bool, fp16: bool, has_bias: bool, index: int) -> None:
    for mt in ROW_TILES:
        cfg = base_config(gated, mt)
        warps, unit, ct, _ = _launch_shape(n_out, k, gated, mt, cfg)
        _compile(warps, unit, cfg["depth"], mt, ct, gated, fp16, has_bias, index)


def _prepare_key(weight: torch.Tensor, gated: bool, has_bias: bool) -> tuple:
    """`_prepare`'s arguments for a weight: what its compiled variants depend on."""
    index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
    return (weight.shape[0] // (2 if gated else 1), weight.shape[1], gated, weight.dtype == torch.float16, has_bias,
            index)


def prepare(weight: torch.Tensor, gated: bool = False, has_bias: bool = False) -> None:
    """Compile (NVRTC) every row-tile variant a weight's calls will launch: a compile inside CUDA-graph capture
    fails, so the first (eager) call, or the model's load, does it."""
    if weight.device.type == "cuda":
        _prepare(*_prepare_key(weight, gated, has_bias))


def warm_up(layers: list[tuple[torch.Tensor, bool, bool]], max_workers: int = 8) -> int:
    """Compile every variant that (weight, gated, has_bias) products will launch, in threads (NVRTC and the module
    load run outside the GIL), so that neither graph capture nor serving waits for a compile; returns the number of
    distinct weight shapes. Weights the kernel cannot read are skipped."""
    from concurrent.futures import ThreadPoolExecutor

    keys = {_prepare_key(weight, gated, has_bias) for weight, gated, has_bias in layers
            if weight.device.type == "cuda" and layout_problem(weight, gated) is None}

    def compile_in_thread(key):
        torch.cuda.synchronize(key[-1])  # a runtime call: binds the device's primary context to this thread
        _prepare(*key)

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(keys)))) as pool:
            list(pool.map(compile_in_thread, keys))
    except Exception:  # a driver that refuses module loads off the main thread: what is left, one by one
        for key in keys:
            _prepare(*key)
    return len(keys)


def gemv_mma(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, gated: bool = False,
             config: Optional[dict] = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, rows 16-byte aligned) @ weight^T (+ bias) -> [M, N]; gated: weight [2 N', K] (gate
    rows, then up rows) -> silu(gate) * up [M, N']."""
    unknown = set(config or ()) - set(CONFIG)
    if unknown:
        raise ValueError(f"unknown gemv_mma launch options {sorted(unknown)}; known: {sorted(CONFIG)}")
    m, k = x.shape
    n_total = weight.shape[0]
    n_out = n_total // 2 if gated else n_total
    problem = layout_problem(weight, gated)
    assert problem is None, problem
    assert weight.shape[1] == k and x.dtype == weight.dtype and x.stride(1) == 1 and m <= MAX_ROWS, (
        x.shape, weight.shape)
    assert (x.stride(0) % 8 == 0 or m == 1) and x.data_ptr() % 16 == 0, "rows must be 16-byte aligned"
    if bias is not None:
        assert bias.shape == (n_total,) and bias.stride(0) == 1 and bias.dtype == x.dtype, bias.shape
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0 or n_out == 0:
        return out
    mt = next(mt for mt in ROW_TILES if m <= 8 * mt)
    cfg = {**base_config(gated, mt), **(config or {})}
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if not config:
        prepare(weight, gated, bias is not None)  # every row tile at once (cached): none compiles under capture
    warps, unit, ct, blocks = _launch_shape(n_out, k, gated, mt, cfg)
    kernel = _compile(warps, unit, cfg["depth"], mt, ct, gated, x.dtype == torch.float16, bias is not None, index)
    grid, block = (blocks, (m + 8 * mt - 1) // (8 * mt), 1), (32 * warps, 1, 1)
    args = [weight, x, bias if bias is not None else x, out, m, n_out, k, weight.stride(0), x.stride(0),
            out.stride(0), n_out]
    from pagedllm.kernels.pdl import use_pdl

    if use_pdl(x.device):
        _launch_pdl(kernel, grid, block, args)
    else:
        kernel(grid=grid, block=block, args=args)
    return out
