"""CPU decode steps of Llama-style models with GGUF-packed weights in one C++ call (kernels/csrc/cpu_fused.cpp).

A step of a few tokens spends most of its time outside the kernels when each layer's ~15 ops (norms,
projections, rope, KV write, attention, views, allocations) are dispatched one by one from Python; the
`decode_stack` op runs the same kernels over every layer in C++. The loader attaches a `CpuDecodePath` to every
LlamaModel it builds on the CPU (`attach`: `LlamaModel.fast_path`, which the model's forward calls first; the
model never imports this module). It returns the final hidden states when the step qualifies, else None and the
model runs its layers as usual; the two paths compute the same numbers
(tests/quantization/test_cpu_decode_stack.py).

A model qualifies when every layer is the plain Llama layer (Qwen2's biases and Qwen3's per-head q/k norm
included) or every layer is Gemma's (models/gemma2.py: Gemma 2's soft-capped attention logits, Gemma 3's q/k norms
and per-layer rope bases included), with all four projections kept packed
(`GGUFLinearMethod`), float32, one tensor/pipeline-parallel rank; a step when it has fewer than `DENSE_MIN_ROWS`
tokens (more go through the dense oneDNN path, layer by layer) and runs on the CPU attention backend with every KV
cache bound. PAGEDLLM_CPU_FUSED_DECODE=0 turns it off.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from pagedllm import envs
from pagedllm.models.gemma2 import Gemma2DecoderLayer, GemmaMLP
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel

logger = logging.getLogger("pagedllm")

_UNSET = object()


def attach(model: Any) -> None:
    """Give a model built on the CPU (a *ForCausalLM around a LlamaModel) the fused decode path."""
    inner = getattr(model, "model", None)
    if isinstance(inner, LlamaModel):
        inner.fast_path = CpuDecodePath(inner)


class CpuDecodePath:
    """`LlamaModel.fast_path`: the stack is built at the first step, once whatever the runner adds after loading
    (LoRA wrappers, say) is in place, and kept (`stack`: None when the model does not qualify)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.stack: Any = _UNSET

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """The final (normed) hidden states [T, hidden] of the model for this step, or None."""
        if input_ids.device.type != "cpu":
            return None
        if self.stack is _UNSET:
            self.stack = _build(self.model)
        if self.stack is None:
            return None
        return self.stack(input_ids, positions)

    def reset(self) -> None:
        """Sleep mode moved or reloaded the weights: the stack's argument lists name the old tensors."""
        self.stack = _UNSET


def _build(model: Any) -> Optional["DecodeStack"]:
    if not envs.PAGEDLLM_CPU_FUSED_DECODE:
        return None
    try:
        reason = _unsupported(model)
    except AttributeError as e:  # a model shaped differently from LlamaModel
        reason = f"unexpected model structure ({e})"
    if reason is not None:
        logger.debug("CPU decode stack off: %s", reason)
        return None
    from pagedllm.kernels.cpu_ops import cpu_ops
    ops = cpu_ops()
    if ops is None or not hasattr(ops, "decode_stack"):
        return None
    return DecodeStack(model, ops)


def _layer_kind(layer: Any) -> Optional[str]:
    """"llama" or "gemma" for the layer forwards the stack reproduces, else None."""
    from pagedllm.layers.activation import GeluAndMul, SiluAndMul

    attn, mlp = layer.self_attn, layer.mlp
    if type(attn).forward is not LlamaAttention.forward:
        return None
    if type(layer).forward is LlamaDecoderLayer.forward and type(mlp).forward is LlamaMLP.forward \
            and isinstance(mlp.act_fn, SiluAndMul):
        return "llama"
    if type(layer).forward is Gemma2DecoderLayer.forward and type(mlp).forward is GemmaMLP.forward \
            and type(mlp.act_fn) is GeluAndMul and mlp.act_fn.approximate == "tanh":
        return "gemma"
    return None


def _layer_norms(layer: Any, kind: str) -> list[Any]:
    """The layer's norms in the order `decode_stack` takes them."""
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if kind == "gemma":
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    return norms


def _unsupported(model: Any) -> Optional[str]:
    """Why `model` cannot use the fused stack, or None."""
    from pagedllm.layers.layernorm import GemmaRMSNorm, RMSNorm
    from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from pagedllm.layers.rotary_embedding import RotaryEmbedding
    from pagedllm.quantization.gguf import GGUFLinearMethod

    if not (model.is_first_stage and model.is_last_stage):
        return "pipeline parallelism"
    layers = list(model.layers[model.start_layer:model.end_layer])
    if not layers or model.rotary_emb.cos_sin_cache.device.type != "cpu":
        return "no layers on the CPU"
    kinds = {_layer_kind(layer) for layer in layers}
    if None in kinds or len(kinds) != 1:
        return f"{type(layers[0]).__name__} is not a layer the fused stack knows"
    kind = kinds.pop()
    # Gemma's (1 + w) norms hold 1 + w in float32: in a float32 model they are plain RMSNorms to the kernels.
    norm_types = (RMSNorm,) if kind == "llama" else (GemmaRMSNorm,)
    norms = [model.norm]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        rope = attn.rotary_emb
        if type(rope).forward is not RotaryEmbedding.forward or rope.cos_sin_cache.dtype != torch.float32 \
                or rope.cos_sin_cache.device.type != "cpu":
            return "a rotary embedding other than the neox-style C++ one"
        qk = attn.qk_norm()
        if (type(attn).normalize_qk is not LlamaAttention.normalize_qk) != (qk is not None):
            return "a q/k normalization the fused stack does not know"
        if qk is not None and (qk[0].dtype != torch.float32 or qk[1].dtype != torch.float32):
            return "non-float32 q/k norm weights"
        projections = ((attn.qkv_proj, QKVParallelLinear), (attn.o_proj, RowParallelLinear),
                       (mlp.gate_up_proj, MergedColumnParallelLinear), (mlp.down_proj, RowParallelLinear))
        for proj, cls in projections:
            if type(proj) is not cls or not isinstance(proj.linear_method, GGUFLinearMethod) or proj.tp_size != 1:
                return f"{proj.prefix} is not a packed GGUF projection"
            if proj.bias is not None and proj.bias.dtype != torch.float32:
                return f"{proj.prefix} has a non-float32 bias"
        norms += _layer_norms(layer, kind)
    if any(type(n) not in norm_types or n.weight.dtype != torch.float32 for n in norms):
        return "a norm other than the layers' float32 RMSNorm"
    return None


class DecodeStack:
    """The flattened arguments of `decode_stack` for one model; rebuilt when the KV caches are (re)bound."""

    def __init__(self, model: Any, ops: Any) -> None:
        from pagedllm.kernels.gguf_ops import DENSE_MIN_ROWS

        self.model = model
        self.ops = ops
        self.max_tokens = DENSE_MIN_ROWS - 1
        self.layers = list(model.layers[model.start_layer:model.end_layer])
        self.kind = _layer_kind(self.layers[0])
        self.attns = [layer.self_attn.attn for layer in self.layers]
        self.bound: tuple = ()
        self.weights: list[torch.Tensor] = []
        self.layout: list[int] = []
        self.floats: list[float] = []

    def _bind(self) -> bool:
        """(Re)build the argument lists for the current KV caches; False if this step cannot use the stack."""
        caches = tuple(a.kv_cache for a in self.attns)
        if any(c is None or c.dtype != torch.float32 or c.device.type != "cpu" for c in caches) or any(
                a.kv_scale_source is not None for a in self.attns):
            return False
        first = self.layers[0].self_attn
        has_qk_norm = first.qk_norm() is not None
        gemma = self.kind == "gemma"
        layout = [len(self.layers), first.num_heads, first.num_kv_heads, first.head_dim,
                  self.model.norm.weight.numel(), self.layers[0].mlp.gate_up_proj.output_partition_sizes[0],
                  int(has_qk_norm), int(gemma)]
        weights: list[torch.Tensor] = []
        floats: list[float] = []
        for layer, cache in zip(self.layers, caches):
            attn, mlp = layer.self_attn, layer.mlp
            _, num_blocks, block_size, kv_heads, head_size = cache.shape
            norms = _layer_norms(layer, self.kind)
            weights += [n.weight for n in norms]
            # The CPU backend's private block layout (attention/cpu_backend.py).
            weights += [attn.rotary_emb.cos_sin_cache, cache[0].view(num_blocks, kv_heads, head_size, block_size),
                        cache[1].view(num_blocks, kv_heads, block_size, head_size)]
            qk_eps = 0.0
            if has_qk_norm:
                q_w, k_w, qk_eps = attn.qk_norm()
                weights += [q_w, k_w]
            # the layer's window and KV-cache group, ahead of its projections
            layout += [attn.attn.sliding_window or 0, attn.attn.kv_group]
            for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                method = proj.linear_method
                parts, types = method.parts(proj), proj.__dict__["_gguf_types"]
                layout += [len(parts), int(proj.bias is not None), *types]
                weights += parts + ([proj.bias] if proj.bias is not None else [])
            eps = [n.variance_epsilon for n in norms] + [0.0] * (4 - len(norms))
            floats += eps + [float(qk_eps), attn.attn.scale, attn.attn.logits_soft_cap or 0.0]
        weights.append(self.model.norm.weight)
        floats.append(self.model.norm.variance_epsilon)
        self.weights, self.layout, self.floats, self.bound = weights, layout, floats, caches
        return True

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        from pagedllm.attention.cpu_backend import CpuAttentionBackend
        from pagedllm.forward_context import get_forward_context, with_input_embeds

        num_tokens = input_ids.shape[0]
        if not 0 < num_tokens <= self.max_tokens or input_ids.device.type != "cpu":
            return None
        ctx = get_forward_context()
        if ctx is None or ctx.attn_metadata is None or not isinstance(ctx.attn_backend, CpuAttentionBackend):
            return None
        if not self.bound or self.attns[0].kv_cache is not self.bound[0] \
                or self.attns[-1].kv_cache is not self.bound[-1]:
            if not self._bind():
                return None
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            return None
        hidden = with_input_embeds(self.model.embed(input_ids))
        if hidden.dtype != torch.float32:
            return None
        hidden = hidden.contiguous()
        meta = ctx.attn_metadata
        groups = meta.kv_groups or [meta]
        out = torch.empty_like(hidden)
        self.ops.decode_stack(out, hidden, positions, self.weights, self.layout, self.floats,
                              [g.slot_mapping for g in groups], [g.block_table for g in groups],
                              meta.query_start_loc, meta.seq_lens, meta.num_actual_tokens)
        return out
