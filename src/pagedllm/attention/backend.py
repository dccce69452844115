"""AttentionBackend: the pluggable part behind every `Attention` layer, plus its registry.

A backend owns two jobs for one layer and one flattened batch (see forward_context.AttentionMetadata):
  1. write the new tokens' K/V into the paged cache at `slot_mapping`;
  2. compute causal attention of each request's query tokens over its whole context read through its
     block table (prefix-cached blocks, earlier chunks, and this step's tokens alike), or with a sliding window
     over its last `sliding_window` positions only: table entries of blocks wholly before a row's window may be
     stale (the KV manager freed those blocks), so a backend must not read them.

KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_size] (index 0 = K, 1 = V).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedllm.forward_context import AttentionMetadata


@dataclass(frozen=True)
class QKVSpec:
    """One attention layer as a fused qkv path sees it (`AttentionBackend.forward_qkv`)."""

    num_heads: int  # on this tensor-parallel rank
    num_kv_heads: int
    head_size: int
    scale: float
    # Per-head RMSNorm of q and k before rope (Qwen3): both weights [head_size] or neither.
    q_norm_weight: Optional[torch.Tensor] = None
    k_norm_weight: Optional[torch.Tensor] = None
    eps: float = 1e-6
    # An FP8 cache's per-layer (k_scale, v_scale), float32 [2] on the device (read at run time: CUDA-graph safe).
    # The backend stores K / k_scale, V / v_scale, attends with q * k_scale and returns the output times v_scale.
    # A backend that cannot must return None from forward_qkv when this is set.
    kv_scales: Optional[torch.Tensor] = None
    # Sliding-window attention (None: full): a query at position p sees keys p - sliding_window < k <= p.
    sliding_window: Optional[int] = None
    # Soft-capped scores (None: off; Gemma 2): s -> c * tanh(s / c) before the softmax. A backend without
    # `supports_logits_soft_cap` must return None from forward_qkv when this is set.
    logits_soft_cap: Optional[float] = None
    # A LoRA shrink of the output its consumer (o_proj) wants (kernels/paged_attention.OutputShrink): a backend may
    # compute it on the way and set its `done`; one that does not leaves it to the consumer.
    output_shrink: Optional[Any] = None


class AttentionBackend:
    name: str = "base"
    # Whether pure-decode metadata should carry `decode_order` (rows longest context first).
    wants_decode_order: bool = False
    # Whether the KV pool must start zeroed (kernels whose masked-out lanes still multiply what they read).
    needs_zeroed_cache: bool = True
    # Whether it reads and writes an FP8 (E4M3) KV pool (`--kv-cache-dtype fp8`).
    supports_fp8_kv: bool = False
    # Whether mixed prefill + decode steps may be captured as CUDA graphs (worker/mixed_graph.py): the backend
    # then launches such a step from shapes alone, given metadata padded to `num_reqs` rows (padding rows: no
    # query tokens) and `AttentionMetadata.graph_prefill_tile` set.
    supports_mixed_graphs: bool = False
    # Whether the metadata's host copies of the sequence lengths (`seq_lens_cpu`, `max_seq_len`) may be upper
    # bounds of the device's `seq_lens` (overlapped speculation shortens them on the device): only for tiling and
    # split choices, never for what is read.
    host_lens_may_be_bounds: bool = False
    # Whether `forward` takes `logits_soft_cap` (cap * tanh(scores / cap) before the softmax; Gemma 2). The layer
    # passes it only when set; a model needing it is refused at start on a backend without it.
    supports_logits_soft_cap: bool = False

    def few_query_tile(self, num_heads: int, num_kv_heads: int, max_query_len: int) -> Optional[int]:
        """A mixed-graph tile id (negative) of a launch for steps whose requests have <= max_query_len query tokens
        each, which `worker/mixed_graph.py` captures besides `mixed_graph_tiles`; None: the backend has none."""
        return None

    def mixed_graph_tiles(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int) -> list[int]:
        """The query tiles (rows of a program) to capture mixed-step graphs for, ascending; each step replays the
        one `worker.mixed_graph.pick_tile` finds cheapest (backends with mixed graphs)."""
        raise NotImplementedError

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: Optional[int] = None,  # a query at position p sees keys p - sliding_window < k <= p
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        raise NotImplementedError

    def forward_qkv(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_size], the projection output
        positions: torch.Tensor,  # [num_tokens]
        cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] = cat(cos, sin)
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        spec: QKVSpec,
    ) -> Optional[torch.Tensor]:
        """Optional fused path from the qkv projection: q/k norm + neox rope + KV write + attention, with
        fewer kernels. Returns [num_tokens, num_heads, head_size], or None to make the caller run the
        unfused ops and `forward` (the default)."""
        return None

    def graph_seq_len_buckets(self, num_reqs: int, num_kv_heads: int, max_model_len: int,
                              device: torch.device) -> list[int]:
        """Upper bounds of the batch's longest context (ascending, the last = max_model_len) that need their own
        decode CUDA graph at this batch size, because the backend's kernel launch differs. Default: one."""
        return [max_model_len]

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Called once per step before the forward (plan shared by all layers). Optional."""


_REGISTRY = {
    "torch": ("pagedllm.attention.torch_backend", "TorchAttentionBackend"),
    "cpu": ("pagedllm.attention.cpu_backend", "CpuAttentionBackend"),
    "triton": ("pagedllm.attention.triton_backend", "TritonAttentionBackend"),
}


def get_attention_backend(name: Optional[str], device: torch.device) -> AttentionBackend:
    """Pick a backend: explicit name, else Triton on CUDA, and on CPU the C++ kernels when they build here
    (else torch)."""
    if name is None:
        if device.type == "cuda":
            name = "triton"
        else:
            from pagedllm.kernels.cpu_ops import cpu_ops

            name = "cpu" if device.type == "cpu" and cpu_ops() is not None else "torch"
    if name not in _REGISTRY:
        raise ValueError(f"Unknown attention backend {name!r}; choose one of {sorted(_REGISTRY)}.")
    module_name, class_name = _REGISTRY[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls()
