"""Few-row 4-bit weight-only GEMV on the tensor cores (CUDA C++ in csrc/qgemv_mma.cu, compiled at first use with
NVRTC through torch), over its own weight layout ("mma").

Why: the CUDA-core GEMVs (kernels/qgemv.py) spend ~3-4 instructions per weight unpacking and multiplying, which on
an H200 caps them near 1.5-1.8 TB/s of int4; here one lop3 and one paired add (the zero point) per two weights make
the MMA operand and the tensor cores do the rest, so the pass is a stream of weights. 1 to 8 input rows cost the same
(they are the MMA's 8 columns); more rows take row tiles of 8 (MT per block, blocks over row blocks of 8 * MT).

The layout, made from the q values in layout-channel order (after the act-order permutation, as in the tiled
layout): int32 [N / 16, K / 64, 32, 4]; word j of lane l = 4 g + t in (column tile nt, chunk c) holds nibble e =
q[nt * 16 + g + 8 * (e & 1)][c * 64 + 16 t + 4 j + 2 * ((e >> 1) & 1) + (e >> 2)]. Scales and zeros stay [G, N] in
the activation dtype; `perm` (act-order) maps layout channels to input channels.
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

import torch

CHUNK = 64  # channels per chunk: one 16-byte load per lane, four MMAs
_NIBBLE_ROW = [e & 1 for e in range(8)]
_NIBBLE_K = [2 * ((e >> 1) & 1) + (e >> 2) for e in range(8)]


def mma_layout_problem(k: int, n: int, bits: int, group_size: int) -> Optional[str]:
    """Why the mma layout cannot hold this weight (None: it can)."""
    if bits != 4:
        return "4-bit weights only"
    if n % 16 or k % CHUNK:
        return f"needs N % 16 == 0 and K % {CHUNK} == 0 (N={n}, K={k})"
    if group_size % CHUNK and group_size != k:
        return f"group_size {group_size} is not a multiple of {CHUNK}"
    return None


def to_mma_layout(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers 0..15 (layout-channel order) -> int32 [N / 16, K / 64, 32, 4]."""
    n, k = q.shape
    qv = q.to(torch.int32).view(n // 16, 2, 8, k // CHUNK, 4, 4, 4)  # (nt, h, g, c, t, j, ko)
    qv = qv.permute(0, 3, 2, 4, 5, 1, 6)  # (nt, c, g, t, j, h, ko)
    word = torch.zeros(qv.shape[:5], dtype=torch.int32, device=q.device)
    for e in range(8):
        word |= qv[..., _NIBBLE_ROW[e], _NIBBLE_K[e]] << (4 * e)
    return word.reshape(n // 16, k // CHUNK, 32, 4).contiguous()


def from_mma_layout(words: torch.Tensor) -> torch.Tensor:
    """The inverse of to_mma_layout: int32 [N / 16, K / 64, 32, 4] -> q [N, K] (layout-channel order)."""
    nt, c = words.shape[:2]
    w = words.view(nt, c, 8, 4, 4)  # (nt, c, g, t, j)
    q = torch.zeros(nt, c, 8, 4, 4, 2, 4, dtype=torch.int32, device=words.device)
    for e in range(8):
        q[..., _NIBBLE_ROW[e], _NIBBLE_K[e]] = (w >> (4 * e)) & 15
    return q.permute(0, 5, 2, 1, 3, 4, 6).reshape(nt * 16, c * CHUNK)  # (nt, h, g, c, t, j, ko)


def dequantize_mma(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                   perm: Optional[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [N, K] weight (input-channel order) of an mma-layout layer."""
    q = from_mma_layout(words).to(dtype)  # [N, K'] layout order
    k = q.shape[1]
    groups = torch.arange(k, device=q.device) // (k if group_size == -1 else group_size)
    w = (q - zeros.to(dtype)[groups].t()) * scales.to(dtype)[groups].t()
    if perm is not None:
        out = torch.empty_like(w)
        out[:, perm.long()] = w
        w = out
    return w


@functools.lru_cache(maxsize=None)
def cuda_source(name: str) -> str:
    """csrc/<name> after csrc/mma_common.cuh (its conversions and MMA), as NVRTC compiles it (no include paths)."""
    parts = []
    for file in ("mma_common.cuh", name):
        with open(os.path.join(os.path.dirname(__file__), "csrc", file)) as f:
            parts.append(f.read())
    return "\n".join(parts)


def _source() -> str:
    return cuda_source("qgemv_mma.cu")


ROW_TILES = (1, 2, 4, 8)  # MT variants: 8 * MT rows per block


def _warps(warps: int, mt: int) -> int:
    return min(warps, 64 // mt)  # the reduction's shared memory: warps * mt * 512 bytes


def _depth(depth: int, mt: int) -> int:
    """Units in flight per warp for row tile count `mt`: `depth` at one tile, fewer as the accumulators take the
    registers (nvcc -Xptxas -v: ~30 registers per unit at UNIT 2)."""
    return max(2, depth // mt)


@functools.lru_cache(maxsize=None)
def _compile(warps: int, unit: int, depth: int, fp16: bool, has_perm: bool, has_bias: bool, device_index: int,
             mt: int, ct: int = 1):
    compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
    if compile_kernel is None:
        raise RuntimeError("torch.cuda._compile_kernel (NVRTC) is not in this torch")
    major, minor = torch.cuda.get_device_capability(device_index)
    defines = (f"#define WARPS {_warps(warps, mt * ct)}\n#define UNIT {unit}\n#define MT {mt}\n#define CT {ct}\n"
               f"#define DEPTH {_depth(depth, mt * ct)}\n"
               f"#define IS_FP16 {int(fp16)}\n#define HAS_PERM {int(has_perm)}\n#define HAS_BIAS {int(has_bias)}\n")
    with torch.cuda.device(device_index):
        return compile_kernel(defines + _source(), "qgemv_mma", compute_capability=f"{major}{minor}")


def _variant(warps: Optional[int], column_tiles: int, unit: Optional[int], depth: int, fp16: bool, has_perm: bool,
             has_bias: bool, device_index: int, ct: Optional[int], group_chunks: int, mt: int) -> tuple:
    """(kernel, warps per block, column tiles per block) of one row-tile count; None: the defaults
    (`default_warps`, `default_tiling`)."""
    if ct is None or unit is None:
        sms = torch.cuda.get_device_properties(device_index).multi_processor_count
        default_ct, default_unit = default_tiling(column_tiles, mt, sms)
        ct = default_ct if ct is None else ct
        unit = default_unit if unit is None else unit
    ct, unit = _column_tiles(ct, column_tiles), _unit(unit, group_chunks)
    base = warps or default_warps(column_tiles, mt)
    return _compile(base, unit, depth, fp16, has_perm, has_bias, device_index, mt, ct), _warps(base, mt * ct), ct


@functools.lru_cache(maxsize=None)
def _kernels(warps: Optional[int], column_tiles: int, unit: Optional[int], depth: int, fp16: bool, has_perm: bool,
             has_bias: bool, device_index: int, ct: Optional[int], group_chunks: int) -> dict:
    """Every row-tile variant at once, so that the first (eager) call compiles what later row counts need: a
    compile (module load) inside CUDA-graph capture is not allowed. Values: (kernel, warps, column tiles per block)."""
    return {mt: _variant(warps, column_tiles, unit, depth, fp16, has_perm, has_bias, device_index, ct, group_chunks,
                         mt)
            for mt in ROW_TILES}


@functools.lru_cache(maxsize=None)
def _dequant_kernel(fp16: bool, device_index: int):
    defines = f"#define WARPS 1\n#define UNIT 1\n#define MT 1\n#define IS_FP16 {int(fp16)}\n#define HAS_PERM 0\n#define HAS_BIAS 0\n"
    major, minor = torch.cuda.get_device_capability(device_index)
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(defines + _source(), "dequant_mma", compute_capability=f"{major}{minor}")


# Dense-weight buffers of the many-rows path, one per (device, dtype, shape), kept for the process: a CUDA graph
# that captured one keeps its address, so a buffer is never replaced.
_SCRATCH: dict = {}


def dense_weight(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The layer's dense weight [N, K] in the scales' dtype and layout-channel order (csrc/qgemv_mma.cu:
    dequant_mma), in a buffer shared by every layer of that shape."""
    nt, chunks = words.shape[:2]
    n, k = nt * 16, chunks * CHUNK
    key = (words.device, scales.dtype, n, k)
    out = _SCRATCH.get(key)
    if out is None:
        out = _SCRATCH[key] = torch.empty(n, k, dtype=scales.dtype, device=words.device)
    group_chunks = (k if group_size == -1 else group_size) // CHUNK
    kernel = _dequant_kernel(scales.dtype == torch.float16,
                             words.device.index if words.device.index is not None else torch.cuda.current_device())
    kernel(grid=((nt * chunks + 3) // 4, 1, 1), block=(128, 1, 1), args=[words, scales, zeros, out, n, k, group_chunks])
    return out


def kernel_available(device: torch.device) -> Optional[str]:
    """Why the kernel cannot run on `device` (None: it can): mma.m16n8k16 with bf16 needs compute capability 8.0,
    NVRTC comes through torch.cuda._compile_kernel."""
    if device.type != "cuda":
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "needs compute capability >= 8.0"
    if getattr(torch.cuda, "_compile_kernel", None) is None:
        return "this torch has no torch.cuda._compile_kernel (NVRTC)"
    return None


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)),
                ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.lru_cache(maxsize=None)
def _launch_kernel_ex():
    """libcuda's cuLaunchKernelEx, loaded once (a CDLL per launch cost tens of microseconds of host time)."""
    fn = torch.cuda._utils._get_gpu_runtime_library().cuLaunchKernelEx
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _pdl_attr() -> _LaunchAttr:
    attr = _LaunchAttr()
    attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value = (1).to_bytes(4, "little") + bytes(60)
    return attr


_PDL_ATTR = _pdl_attr()


_LAUNCH_BLOCKS: dict[int, tuple] = {}


def _launch_block(n: int) -> tuple:
    """(argument slots, their addresses' array address, launch config, its address) for n arguments, made once per n
    and rewritten by each launch (cuLaunchKernelEx copies the arguments before it returns; the engine launches
    from one thread per device)."""
    block = _LAUNCH_BLOCKS.get(n)
    if block is None:
        values = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(values)
        params = (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8))
        cfg = _LaunchConfig()
        cfg.attrs, cfg.num_attrs = ctypes.pointer(_PDL_ATTR), 1
        block = _LAUNCH_BLOCKS[n] = (values, params, ctypes.addressof(params), cfg, ctypes.addressof(cfg))
    return block


def _launch_pdl(kernel, grid: tuple, block: tuple, args: list) -> None:
    """cuLaunchKernelEx with programmatic stream serialization (kernels/pdl.py): the kernel may start while the one
    before it finishes; it loads its weights, then `griddepcontrol.wait`s before reading x.

    The arguments are pointers (tensors) and 32-bit ints: each is stored in an 8-byte slot of one array (an int in
    its low 4 bytes, little-endian, which is what the kernel reads), and the kernel gets the slots' addresses; the
    arrays and the launch config are made once per argument count (`_launch_block`) and only written per launch
    (host time, on every eager step)."""
    values, _, params_addr, cfg, cfg_addr = _launch_block(len(args))
    values[:] = [a.data_ptr() if isinstance(a, torch.Tensor) else a & 0xFFFFFFFF for a in args]
    cfg.grid_x, cfg.grid_y, cfg.grid_z = grid
    cfg.block_x, cfg.block_y, cfg.block_z = block
    cfg.stream = torch.cuda.current_stream().cuda_stream
    err = _launch_kernel_ex()(cfg_addr, kernel.func, params_addr, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {err}")


# warps None: by the grid and the row tiles (`default_warps`); depth: units in flight per warp at one row tile
# (`_depth`; deeper rings measured slower: docs/benchmarks.md); ct: column tiles per block sharing each x fragment,
# unit: chunks per load (None: by the row tiles and the grid, `default_tiling`)
CONFIG = {"warps": None, "unit": None, "depth": 2, "ct": None}
# Most rows the GEMV takes; above, the weight is dequantized into a buffer and multiplied by cuBLAS
# (benchmarks/qgemv_mma.py measures both; numbers in docs/benchmarks.md).
MMA_MAX_ROWS = 64


def default_warps(column_tiles: int, mt: int = 1) -> int:
    """Warps per block (they split K). One row tile: about 4096 warps in all, 4 to 16 per block; more row tiles: 8
    (benchmarks/qgemv_mma.py --sweep: the best per 8B layer at 1 and at 16 rows)."""
    if mt > 1:
        return 8
    warps = 16
    while warps > 4 and column_tiles * warps > 4096:
        warps //= 2
    return warps


def default_tiling(column_tiles: int, mt: int, sms: int) -> tuple:
    """(column tiles per block, chunks per unit) for `mt` row tiles on a GPU of `sms` multiprocessors. From 4 row
    tiles on, x is read from L2 once per block and a block of two column tiles halves that; at 8 row tiles the
    registers then afford units of one chunk, and only when the halved grid still covers every SM (the sweep of
    benchmarks/qgemv_mma.py: docs/benchmarks.md, round 4)."""
    if mt == 4:
        return 2, 2
    if mt >= 8 and column_tiles // 2 > sms:
        return 2, 1
    return 1, 2


def _column_tiles(ct: int, column_tiles: int) -> int:
    """Column tiles per block: at most `ct`, dividing the layer's tiles."""
    while column_tiles % ct:
        ct //= 2
    return max(1, ct)


def _next_pow2(v: int) -> int:
    return 1 << (max(1, v) - 1).bit_length()


def _group_shift(group_size: int, k: int) -> int:
    """The kernel's group of chunk c: c >> shift (groups of a power of two chunks; one group over K: 30), else
    c / -shift."""
    if group_size == -1 or group_size >= k:
        return 30
    group_chunks = group_size // CHUNK
    if group_chunks & (group_chunks - 1) == 0:
        return group_chunks.bit_length() - 1
    return -group_chunks


def _unit(unit: int, group_chunks: int) -> int:
    """Chunks per unit: at most `unit`, dividing the group (a unit never spans two groups)."""
    while group_chunks % unit:
        unit //= 2
    return unit


def prepare(words: torch.Tensor, dtype: torch.dtype, group_size: int, has_perm: bool, has_bias: bool) -> None:
    """Compile (NVRTC) what a layer's calls will launch, at load time: a compile inside CUDA-graph capture fails."""
    if words.device.type != "cuda":
        return
    index = words.device.index if words.device.index is not None else torch.cuda.current_device()
    k = words.shape[1] * CHUNK
    _kernels(CONFIG["warps"], words.shape[0], CONFIG["unit"], CONFIG["depth"], dtype == torch.float16, has_perm,
             has_bias, index, CONFIG["ct"], (k if group_size == -1 else group_size) // CHUNK)
    _dequant_kernel(dtype == torch.float16, index)


def quant_gemv_mma(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int, perm: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                   config: Optional[dict] = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16, rows 16-byte aligned) @ dequant(W)^T (+ bias) -> [M, N]."""
    unknown = set(config or ()) - set(CONFIG) - {"mt"}
    if unknown:
        raise ValueError(f"unknown qgemv_mma launch options {sorted(unknown)}; known: {sorted(CONFIG)} and mt")
    cfg = {**CONFIG, **(config or {})}
    m, k = x.shape
    nt, chunks = words.shape[:2]
    n = nt * 16
    assert k == chunks * CHUNK and x.dtype in (torch.float16, torch.bfloat16)
    assert scales.dtype == x.dtype and zeros.dtype == x.dtype and x.stride(1) == 1
    assert (x.stride(0) % 8 == 0 or m == 1) and x.data_ptr() % 16 == 0, "rows must be 16-byte aligned"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    group_chunks = (k if group_size == -1 else group_size) // CHUNK
    mt = cfg.get("mt") or min(8, _next_pow2((m + 7) // 8))
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    key = (cfg["warps"], nt, cfg["unit"], cfg["depth"], x.dtype == torch.float16, perm is not None, bias is not None,
           index, cfg["ct"], group_chunks)
    # a row tile given by the caller compiles that variant alone (benchmark sweeps); else every one at once
    kernel, warps, ct = _variant(*key, mt) if cfg.get("mt") else _kernels(*key)[mt]
    grid, block = (nt // ct, (m + 8 * mt - 1) // (8 * mt), 1), (32 * warps, 1, 1)
    args = [words, x, scales, zeros, perm if perm is not None else words, bias if bias is not None else x,
            out, m, n, k, x.stride(0), out.stride(0), _group_shift(group_size, k)]
    from pagedllm.kernels.pdl import use_pdl  # (imports triton: not at module level, the CPU path has none)

    if use_pdl(x.device):
        _launch_pdl(kernel, grid, block, args)
    else:
        kernel(grid=grid, block=block, args=args)
    return out
