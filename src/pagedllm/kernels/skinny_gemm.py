"""y = x @ W.T (+ b) for few rows (decode batches of 1-16 tokens), bf16/fp16, weight-streaming (Triton).

At batch 1-16 a linear layer only streams its weight from memory. cuBLAS picks tiles that leave SMs idle on
some decode shapes (e.g. an 8B model's qkv projection: 96 tiles for 132 SMs) or split K and add a reduce
kernel. This kernel gives every program BLOCK_N output columns over the whole K (no split, no second
kernel), padding the rows to the 16 that tensor cores need (free: the step is memory-bound).

Which implementation a layer uses is decided per (rows, N, K, dtype) by timing both once, on the device,
outside CUDA-graph capture (see `SkinnyGemmSelector`); only a measured win switches a shape over.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

logger = logging.getLogger("pagedllm")

MAX_ROWS = 16


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k + rk) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def default_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): measured on an H200 (benchmarks/kernels_gemm.py)."""
    return 32, 256, 4, 4


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                config: Optional[tuple[int, int, int, int]] = None) -> torch.Tensor:
    """x [M <= 16, K] @ weight[N, K].T (+ bias[N]) -> [M, N] in x's dtype (fp32 accumulation)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
    if x.stride(1) != 1:
        x = x.contiguous()
    assert weight.stride(1) == 1
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, block_k, num_warps, num_stages = config or default_config(n, k)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=num_warps, num_stages=num_stages)
    return out


def _bucket(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length()  # 1, 2, 4, 8, 16


class SkinnyGemmSelector:
    """Per (row bucket, N, K, dtype, device): does `skinny_gemm` beat F.linear? Timed once under CUDA-graph
    replay, never inside a capture. The model runner's graph warm-up hits every bucket before serving."""

    def __init__(self) -> None:
        self._wins: dict[tuple, bool] = {}

    def use_skinny(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
        if (not x.is_cuda or x.dim() != 2 or x.shape[0] > MAX_ROWS or x.shape[0] == 0
                or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype
                or weight.stride(1) != 1 or (bias is not None and bias.dtype != x.dtype)):
            return False
        key = (_bucket(x.shape[0]), weight.shape[0], weight.shape[1], x.dtype, x.device)
        win = self._wins.get(key)
        if win is None:
            if torch.cuda.is_current_stream_capturing():
                return False  # never time inside a capture
            win = self._wins[key] = self._measure(key[0], x, weight, bias)
            logger.debug("skinny_gemm %s: %s", key[:3], "Triton" if win else "cuBLAS")
        return win

    @staticmethod
    def _measure(rows: int, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
        xs = torch.randn(rows, x.shape[1], dtype=x.dtype, device=x.device)
        try:
            ours = skinny_gemm(xs, weight, bias)
        except Exception as e:  # pragma: no cover - a Triton/driver problem: keep cuBLAS
            logger.warning("skinny_gemm unavailable (%s); using cuBLAS for small batches.", e)
            return False
        ref = F.linear(xs, weight, bias)
        if not torch.allclose(ours.float(), ref.float(), atol=2e-2, rtol=2e-2):
            logger.warning("skinny_gemm disagrees with cuBLAS on %s x %s; not used.", tuple(xs.shape),
                           tuple(weight.shape))
            return False
        # Several weight copies (>= 64 MiB in all) so that small weights are not timed from L2, as in a forward
        # pass where each layer's weight is read once.
        copies = min(8, -(-(64 << 20) // max(1, weight.numel() * weight.element_size())))
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        t_ours = triton.testing.do_bench_cudagraph(lambda: [skinny_gemm(xs, w, bias) for w in weights], rep=10)
        t_ref = triton.testing.do_bench_cudagraph(lambda: [F.linear(xs, w, bias) for w in weights], rep=10)
        return t_ours < 0.97 * t_ref


SELECTOR = SkinnyGemmSelector()
