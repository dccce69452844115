"""Attention with its logits soft-capped (Gemma 2's attn_logit_softcapping): softmax(cap * tanh(scale q.k / cap)),
in plain torch as transformers' eager attention computes it (torch's SDPA has no hook between the scores and the
softmax). `soft_capped_sdpa` takes F.scaled_dot_product_attention's arguments, so the torch and CPU backends and
the no-cache path swap it in for SDPA where a layer caps (the Triton kernels cap in their own score tiles)."""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def soft_capped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False, scale: Optional[float] = None,
                     enable_gqa: bool = False, *, soft_cap: float) -> torch.Tensor:
    """F.scaled_dot_product_attention with soft-capped logits. query [..., H, Q, D]; key / value [..., KVH, S, D]
    (with enable_gqa, query head h reads kv head h // (H / KVH)); attn_mask bool (True: visible) or additive,
    broadcast to [..., H, Q, S]; is_causal: the top-left causal mask, as SDPA's. -> [..., H, Q, D]."""
    if enable_gqa and query.shape[-3] != key.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # [..., H, Q, S]
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else \
            scores + attn_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)


def sdpa_for(soft_cap: Optional[float]) -> Callable[..., torch.Tensor]:
    """torch's SDPA, or its soft-capped twin for a layer with a cap."""
    return F.scaled_dot_product_attention if soft_cap is None else functools.partial(soft_capped_sdpa,
                                                                                     soft_cap=soft_cap)
