"""Attention layer: the model-facing wrapper around the paged KV cache and the chosen backend."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.attention.backend import QKVSpec
from pagedllm.attention.soft_cap import sdpa_for
from pagedllm.forward_context import get_forward_context
from pagedllm.layers.kv_cache_scales import calibrated_scales


class Attention(nn.Module):
    """Causal self-attention over the paged KV cache.

    The model runner binds `kv_cache` ([2, num_blocks, block_size, num_kv_heads, head_size]) after
    allocating the pool; until then (memory profiling) attention runs on the batch alone.

    `sliding_window` (None: full attention) has transformers' meaning: a query at position p sees the keys at
    positions p - sliding_window < k <= p, i.e. the last `sliding_window` tokens including itself.
    `logits_soft_cap` (None: off; Gemma 2's attn_logit_softcapping) replaces each scaled score s by
    cap * tanh(s / cap) before the softmax (attention/soft_cap.py); backends without `supports_logits_soft_cap`
    are refused at start (`check_backend_features`).
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 prefix: str = "", sliding_window: Optional[int] = None,
                 logits_soft_cap: Optional[float] = None) -> None:
        super().__init__()
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"{prefix or 'Attention'}: logits_soft_cap must be positive or None, got "
                             f"{logits_soft_cap!r}.")
        self.logits_soft_cap = logits_soft_cap
        # Passed to the backend only when set: backends that never soft-cap need not take the keyword.
        self._soft_cap_kwargs = {} if logits_soft_cap is None else {"logits_soft_cap": logits_soft_cap}
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"{prefix or 'Attention'}: sliding_window must be a positive integer or None, got "
                             f"{sliding_window!r}.")
        self.sliding_window = sliding_window
        # The KV-cache group whose block table this layer reads (core/kv_cache_groups.py; set by the runner).
        self.kv_group = 0
        self.num_heads = num_heads  # heads on this tensor-parallel rank
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:  # a config's error (grouped-query attention shares whole groups)
            raise ValueError(f"{prefix or 'Attention'}: {self.num_heads} attention heads are not a multiple of "
                             f"{self.num_kv_heads} KV heads; check num_attention_heads and num_key_value_heads in "
                             f"config.json.")
        self.prefix = prefix
        self.kv_cache: Optional[torch.Tensor] = None
        # Per-layer scales of an FP8 KV cache (layers/kv_cache_scales.py): the cache holds K / k_scale and
        # V / v_scale in E4M3. A device tensor (k, v), so captured CUDA graphs read the current values.
        self.register_buffer("kv_scales", torch.ones(2, dtype=torch.float32), persistent=False)
        # "checkpoint" | "calibrated" | "pending" (calibrated by the first step) | None: unscaled (1.0)
        self.kv_scale_source: Optional[str] = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # query: [num_tokens, num_heads * head_size]; key/value: [num_tokens, num_kv_heads * head_size]
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        ctx = get_forward_context()
        if ctx is None or ctx.attn_metadata is None or self.kv_cache is None:
            out = self._no_cache_attention(q, k, v)
        elif self.kv_cache.dtype == torch.float8_e4m3fn and self.kv_scale_source is not None:
            md = ctx.attn_metadata.for_group(self.kv_group)
            if self.kv_scale_source == "pending" and getattr(ctx, "calibrate_kv", False):
                real = md.num_actual_tokens
                self.kv_scales.copy_(calibrated_scales(k[:real], v[:real]))
                self.kv_scale_source = "calibrated"
            k_scale, v_scale = self.kv_scales[0], self.kv_scales[1]
            # softmax(scale q . (k_scale k8)) = softmax(scale (k_scale q) . k8); sum p (v_scale v8) = v_scale sum p v8
            out = ctx.attn_backend.forward(q * k_scale, k / k_scale, v / v_scale, self.kv_cache, md,
                                           self.scale, sliding_window=self.sliding_window,
                                           **self._soft_cap_kwargs) * v_scale
        else:
            out = ctx.attn_backend.forward(q, k, v, self.kv_cache, ctx.attn_metadata.for_group(self.kv_group),
                                           self.scale, sliding_window=self.sliding_window, **self._soft_cap_kwargs)
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def set_kv_scale(self, which: str, value: float) -> None:
        """A checkpoint's scale for this layer's FP8 cache ("k" or "v")."""
        if not value > 0:
            raise ValueError(f"{self.prefix}: the checkpoint's {which}_scale is {value}; KV-cache scales must be "
                             f"positive.")
        self.kv_scales[0 if which == "k" else 1] = value
        self.kv_scale_source = "checkpoint"

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> Optional[torch.Tensor]:
        """The backend's fused path from the projection output qkv [num_tokens, q_size + 2 * kv_size]:
        optional per-head q/k RMSNorm (weights, eps), neox rope over the whole head, KV write, attention.
        Returns [num_tokens, num_heads * head_size], or None when the caller must take the unfused path
        (no KV cache bound yet, a backend without the fused path, partial rotary, ...). May modify qkv."""
        ctx = get_forward_context()
        if ctx is None or ctx.attn_metadata is None or self.kv_cache is None:
            return None
        fp8 = self.kv_cache.dtype == torch.float8_e4m3fn and self.kv_scale_source is not None  # scaled FP8
        if fp8 and self.kv_scale_source == "pending" and getattr(ctx, "calibrate_kv", False):
            return None  # the calibration step takes the unfused path, where K is seen after rope
        width = self.num_heads * self.head_size
        # o_proj wrapped by LoRA (lora.manager.link_attention_outputs) may have its shrink computed on the way
        consumer = self.__dict__.get("shrink_consumer")
        shrink = None if consumer is None else consumer.attention_output_shrink(qkv.shape[0], width)
        spec = QKVSpec(self.num_heads, self.num_kv_heads, self.head_size, self.scale,
                       *(qk_norm if qk_norm is not None else ()), kv_scales=self.kv_scales if fp8 else None,
                       sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                       output_shrink=shrink)
        out = ctx.attn_backend.forward_qkv(qkv, positions, cos_sin_cache, self.kv_cache,
                                           ctx.attn_metadata.for_group(self.kv_group), spec)
        if out is None:
            return None
        out = out.reshape(qkv.shape[0], width)
        if shrink is not None and shrink.done:
            consumer.take_output_shrink(out, shrink)
        return out  # (an FP8 cache's v_scale applied by the backend: QKVSpec.kv_scales)

    def _no_cache_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Treat the whole input as one causal sequence (profiling runs, and model tests without an engine)."""
        sdpa = sdpa_for(self.logits_soft_cap)
        # [1, heads, tokens, head_size]
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        gqa = self.num_heads != self.num_kv_heads
        window, num_tokens = self.sliding_window, q.shape[0]
        if window is None or window >= num_tokens:
            out = sdpa(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=gqa)
            return out.squeeze(0).transpose(0, 1)
        # Queries in chunks, each over its keys only, so no [tokens, tokens] mask is ever built.
        out = torch.empty_like(qh)
        chunk = max(window, 256)
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            key_start = max(0, start - window + 1)
            qpos = torch.arange(start, end, device=q.device)[:, None]
            kpos = torch.arange(key_start, end, device=q.device)[None, :]
            mask = (kpos <= qpos) & (kpos > qpos - window)
            out[:, :, start:end] = sdpa(
                qh[:, :, start:end], kh[:, :, key_start:end], vh[:, :, key_start:end], attn_mask=mask,
                scale=self.scale, enable_gqa=gqa)
        return out.squeeze(0).transpose(0, 1)


def check_backend_features(layers: list[Attention], backend: object) -> None:
    """Refuse, at start, a model whose attention layers need what the chosen backend cannot compute."""
    if any(layer.logits_soft_cap is not None for layer in layers) and \
            not getattr(backend, "supports_logits_soft_cap", False):
        raise ValueError(f"This model soft-caps its attention logits (attn_logit_softcapping, Gemma 2), which the "
                         f"{getattr(backend, 'name', backend)} attention backend does not support yet; run it on "
                         f"the CPU, or pass --attention-backend torch.")
