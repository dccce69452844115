"""Attention layer: the model-facing wrapper around the paged KV cache and the chosen backend."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import QKVSpec
from pagedllm.forward_context import get_forward_context


class Attention(nn.Module):
    """Causal self-attention over the paged KV cache.

    The model runner binds `kv_cache` ([2, num_blocks, block_size, num_kv_heads, head_size]) after
    allocating the pool; until then (memory profiling) attention runs on the batch alone.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.num_heads = num_heads  # heads on this tensor-parallel rank
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        assert self.num_heads % self.num_kv_heads == 0
        self.prefix = prefix
        self.kv_cache: Optional[torch.Tensor] = None
        # Per-layer scales of an FP8 KV cache: the cache holds K / k_scale and V / v_scale in E4M3. 1.0 unless
        # set (e.g. from calibration); the fused qkv path handles only 1.0.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # query: [num_tokens, num_heads * head_size]; key/value: [num_tokens, num_kv_heads * head_size]
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        ctx = get_forward_context()
        if ctx is None or ctx.attn_metadata is None or self.kv_cache is None:
            out = self._no_cache_attention(q, k, v)
        elif self.k_scale != 1.0 or self.v_scale != 1.0:
            # softmax(q . (k_scale * k8)) = softmax((scale * k_scale) q . k8); sum p (v_scale * v8) = v_scale * ...
            out = ctx.attn_backend.forward(q, k / self.k_scale, v / self.v_scale, self.kv_cache, ctx.attn_metadata,
                                           self.scale * self.k_scale) * self.v_scale
        else:
            out = ctx.attn_backend.forward(q, k, v, self.kv_cache, ctx.attn_metadata, self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> Optional[torch.Tensor]:
        """The backend's fused path from the projection output qkv [num_tokens, q_size + 2 * kv_size]:
        optional per-head q/k RMSNorm (weights, eps), neox rope over the whole head, KV write, attention.
        Returns [num_tokens, num_heads * head_size], or None when the caller must take the unfused path
        (no KV cache bound yet, a backend without the fused path, partial rotary, ...). May modify qkv."""
        ctx = get_forward_context()
        if ctx is None or ctx.attn_metadata is None or self.kv_cache is None or self.k_scale != 1.0 \
                or self.v_scale != 1.0:
            return None
        spec = QKVSpec(self.num_heads, self.num_kv_heads, self.head_size, self.scale,
                       *(qk_norm if qk_norm is not None else ()))
        out = ctx.attn_backend.forward_qkv(qkv, positions, cos_sin_cache, self.kv_cache, ctx.attn_metadata, spec)
        return None if out is None else out.reshape(qkv.shape[0], self.num_heads * self.head_size)

    def _no_cache_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Treat the whole input as one causal sequence (used for profiling runs only)."""
        # [1, heads, tokens, head_size]
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.squeeze(0).transpose(0, 1)
