"""Llama 2/3 (also Mistral and SmolLM2, which share its layout), tensor-parallel and paged-attention ready.

Shapes below use T = tokens in the flattened batch (all requests' new tokens end to end); the Attention
layer finds request boundaries in the forward context, so nothing here knows about requests.
Qwen2 and Qwen3 reuse these classes, overriding only what differs (qkv bias, per-head q/k norm).
"""
from __future__ import annotations

import logging
import re
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_pp_group
from pagedllm.distributed.pipeline import (UNTIED_HEAD_WARNING, IntermediateTensors, PPMissingLayer, stage_layer_range,
                                          stage_weights)
from pagedllm.forward_context import with_input_embeds
from pagedllm.layers.activation import SiluAndMul, get_gated_act_fn
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.weight_utils import set_default_dtype, set_weight_attrs
from pagedllm.models.weight_utils import load_weights_into

logger = logging.getLogger(__name__)


def get_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_index(prefix: str) -> int:
    """The decoder layer number in a module prefix such as "model.layers.3.self_attn"."""
    match = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", prefix)
    if match is None:
        raise ValueError(f"No layer index in the module prefix {prefix!r}.")
    return int(match.group(1))


# model_type of the transformers models whose every layer takes `sliding_window`, whatever `layer_types` says
WINDOW_ON_EVERY_LAYER = ("mistral", "mixtral", "phi3", "qwen3_moe")
# model_type of the transformers models that never read `use_sliding_window` (a Mistral config.json with layer_types
# loads as "ministral"; Qwen3-MoE's config does read it)
IGNORES_USE_SLIDING_WINDOW = ("mistral", "ministral", "mixtral", "phi3")


# model_type of the transformers models built without projection biases whatever the config says: a stray
# `attention_bias` / `mlp_bias: true` in their config.json loads in transformers (no bias tensors expected)
NO_ATTENTION_BIAS = ("mistral", "ministral", "mixtral", "phi3")  # (Qwen2's q/k/v bias: qwen2.py's own rule)
NO_MLP_BIAS = NO_ATTENTION_BIAS + ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def config_bias(config: Any, field: str, ignored_by: tuple[str, ...]) -> bool:
    """`config.<field>` (attention_bias / mlp_bias) as the family's transformers model reads it."""
    return bool(getattr(config, field, False)) and getattr(config, "model_type", None) not in ignored_by


def layer_sliding_window(config: Any, layer_idx: int) -> Optional[int]:
    """The attention window of decoder layer `layer_idx` as transformers applies it (None: full attention).

    `layer_types` (Qwen2/Qwen3 build it from use_sliding_window + max_window_layers; Gemma, Ministral, ...) picks
    the layers whose type is "sliding_attention". The models of `WINDOW_ON_EVERY_LAYER` ignore `layer_types` (a
    config.json may still carry one) and apply the window to every layer; Llama's has no window (a stray
    `sliding_window` in its config.json is ignored). `use_sliding_window: false` turns the window off, except in
    the models of `IGNORES_USE_SLIDING_WINDOW`."""
    window = getattr(config, "sliding_window", None)
    model_type = getattr(config, "model_type", None)
    if not window or model_type == "llama":
        return None
    if getattr(config, "use_sliding_window", True) is False and model_type not in IGNORES_USE_SLIDING_WINDOW:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and model_type not in WINDOW_ON_EVERY_LAYER:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    return int(window)


# A quantized head's tensors (compressed-tensors / FP8 scales, GPTQ / AWQ packing): the LM head, the
# classifiers' score heads and the token embedding (compressed-tensors' "Embedding" target) are float here
_QUANTIZED_HEAD = re.compile(r"^(?P<head>lm_head|score(?:\.\d+)?|model\.embed_tokens)\.(weight_packed|weight_scale|"
                             r"weight_zero_point|weight_g_idx|input_scale|qweight|qzeros|scales|g_idx)$")


def refuse_quantized_head(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, refusing a quantized lm_head or score head: it was reported as a "missing
    lm_head.weight" / "score.weight" (or, a tied lm_head, dropped silently for the float embedding)."""
    for name, tensor in weights:
        match = _QUANTIZED_HEAD.match(name)
        if match:
            head = match.group("head")
            if head == "model.embed_tokens":  # (was "missing model.embed_tokens.weight", no cause named)
                raise ValueError(f"The checkpoint's token embedding is quantized ({name}), which pagedllm does not "
                                 f"support; use a checkpoint quantized with the embedding left float "
                                 f"(compressed-tensors: no 'Embedding' in the targets).")
            what = "LM head" if head == "lm_head" else f"classification head ({head})"
            raise ValueError(f"The checkpoint's {what} is quantized ({name}), which pagedllm does not support; use "
                             f"a checkpoint quantized with {head} left float (compressed-tensors: {head} in "
                             f"`ignore`; GPTQ: lm_head=false).")
        yield name, tensor


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, prefix: str = "", quant_config: Any = None) -> None:
        super().__init__()
        bias = config_bias(config, "mlp_bias", NO_MLP_BIAS)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias=bias, prefix=f"{prefix}.gate_up_proj",
                                                       quant_config=quant_config)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias,
                                           prefix=f"{prefix}.down_proj", quant_config=quant_config)
        self.act_fn = get_gated_act_fn(config.hidden_act)
        self.fuse_silu = isinstance(self.act_fn, SiluAndMul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuse_silu:  # decode steps of a few tokens on CUDA: gate_up and SiLU in one kernel
            act = self.gate_up_proj.silu_and_mul(x)
            if act is not None:
                return self.down_proj(act)
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate / tp]
        return self.down_proj(self.act_fn(gate_up))  # [T, hidden]


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str = "", quant_config: Any = None
                 ) -> None:
        super().__init__()
        self.head_dim = get_head_dim(config)
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        qkv_bias, o_bias = self.projection_biases(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_num_heads, total_num_kv_heads,
                                          bias=qkv_bias, prefix=f"{prefix}.qkv_proj", quant_config=quant_config)
        self.num_heads = self.qkv_proj.num_heads  # on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_num_heads * self.head_dim, config.hidden_size, bias=o_bias,
                                        prefix=f"{prefix}.o_proj", quant_config=quant_config)
        self.rotary_emb = rotary_emb  # shared by all layers (one cos/sin cache per model)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              prefix=f"{prefix}.attn",
                              sliding_window=layer_sliding_window(config, layer_index(prefix)))

    @staticmethod
    def projection_biases(config: Any) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = config_bias(config, "attention_bias", NO_ATTENTION_BIAS)
        return bias, bias

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, q_size + 2 * kv_size]
        # Backends with a fused path (Triton on CUDA) do q/k norm, rope and the KV write in one kernel.
        out = self.attn.forward_qkv(qkv, positions, self.rotary_emb.cos_sin_cache, self.qk_norm())
        if out is None:
            # q [T, heads * head_dim]; k, v [T, kv_heads * head_dim] (views into qkv)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            # Rotated q/k: new tensors on CPU, rotated in place (still views of qkv) by the Triton kernel on CUDA.
            q, k = self.rotary_emb(positions, *self.normalize_qk(q, k))
            out = self.attn(q, k, v)  # [T, heads * head_dim]
        return self.o_proj(out)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before rope (Qwen3 normalizes each head here); keep `qk_norm` in step with it."""
        return q, k

    def qk_norm(self) -> Optional[tuple[torch.Tensor, torch.Tensor, float]]:
        """(q weight, k weight, eps) of the per-head RMSNorm `normalize_qk` applies, for fused kernels."""
        return None


class PerHeadQKNorm:
    """Mixed in before an attention class (Qwen3, Gemma 3): an RMSNorm (`qk_norm_cls`) over each q and each k head
    before rope, `normalize_qk` for the layer-by-layer path and `qk_norm` for the fused kernels."""

    qk_norm_cls: type = RMSNorm

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str = "", quant_config: Any = None
                 ) -> None:
        super().__init__(config, rotary_emb, prefix, quant_config)
        self.q_norm = self.qk_norm_cls(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = self.qk_norm_cls(self.head_dim, eps=config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        # [T, heads * head_dim] -> per-head norm over head_dim -> [T, heads * head_dim]
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim)).view(num_tokens, -1)
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)).view(num_tokens, -1)
        return q, k

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        assert self.q_norm.variance_epsilon == self.k_norm.variance_epsilon
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon


class LlamaDecoderLayer(nn.Module):
    # What a family swaps (Gemma: its MLP and (1 + w) norms; MoE families: `build_mlp`).
    attention_cls: type = LlamaAttention
    mlp_cls: type = LlamaMLP
    norm_cls: type = RMSNorm

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str = "", quant_config: Any = None
                 ) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, rotary_emb, prefix=f"{prefix}.self_attn",
                                            quant_config=quant_config)
        self.mlp = self.build_mlp(config, f"{prefix}.mlp", quant_config)
        self.input_layernorm = self.norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, eps=config.rms_norm_eps)

    def build_mlp(self, config: Any, prefix: str, quant_config: Any) -> nn.Module:
        """The layer's MLP (`prefix` is its own, `...layers.N.mlp`)."""
        return self.mlp_cls(config, prefix=prefix, quant_config=quant_config)

    def norm_feeds(self) -> list[tuple[str, str]]:
        """(norm, linear layer) pairs, as attribute paths, where the norm's output is that layer's input and nothing
        else's: LoRA computes such a layer's adapter shrink inside the norm kernel (lora/layers.py)."""
        return [("input_layernorm", "self_attn.qkv_proj"), ("post_attention_layernorm", "mlp.gate_up_proj")]

    def input_norm(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_layernorm of the stream, the stream): the residual stream is carried separately and added inside
        the next norm (fused add + norm); the first layer gets none."""
        if residual is None:
            return self.input_layernorm(hidden_states), hidden_states
        return self.input_layernorm(hidden_states, residual)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_norm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def layer_rope(layer: nn.Module, default: nn.Module) -> nn.Module:
    """The rotary embedding a decoder layer's attention rotates with."""
    return getattr(getattr(layer, "self_attn", None), "rotary_emb", default)


class LlamaModel(nn.Module):
    """The decoder stack; with pipeline parallelism only this stage's layer range [start_layer, end_layer) is
    built (the others are PPMissingLayer), the embedding on the first stage, the final norm on the last."""

    # A whole-stack replacement attached from outside (the loader attaches the CPU decode stack,
    # models/cpu_decode.py): (input_ids, positions) -> the final hidden states, or None to run the layers.
    fast_path: Optional[Callable[[torch.Tensor, torch.Tensor], Optional[torch.Tensor]]] = None

    def __init__(self, config: Any, layer_cls: type = LlamaDecoderLayer, prefix: str = "model",
                 quant_config: Any = None) -> None:
        super().__init__()
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        n = config.num_hidden_layers
        self.start_layer, self.end_layer = stage_layer_range(n, pp.rank_in_group, pp.world_size)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                    prefix=f"{prefix}.embed_tokens")
                             if self.is_first_stage else PPMissingLayer())
        rope_parameters = get_rope_parameters(config)
        self.rotary_emb = get_rope(get_head_dim(config), config.max_position_embeddings, rope_parameters)
        self.layers = nn.ModuleList(layer_cls(config, self.rotary_emb, prefix=f"{prefix}.layers.{i}",
                                              quant_config=quant_config)
                                    if self.start_layer <= i < self.end_layer else PPMissingLayer()
                                    for i in range(n))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if self.is_last_stage else PPMissingLayer()

    def rope_positions(self, positions: torch.Tensor, layers: nn.ModuleList
                       ) -> tuple[dict[nn.Module, torch.Tensor], list[nn.Module]]:
        """(each rotary embedding of these layers -> the rows it reads for `positions`, each layer's embedding): the
        model's, and any a layer has of its own (Gemma 3's local layers); LongRoPE's and dynamic NTK's offsets
        index their own table. The layers' embeddings are read once (Gemma 3 sets its local one after this init)."""
        layer_ropes = self.__dict__.get("_layer_ropes")
        if layer_ropes is None:
            layer_ropes = self.__dict__["_layer_ropes"] = [layer_rope(layer, self.rotary_emb) for layer in layers]
        return {rope: rope.model_positions(positions) for rope in dict.fromkeys([self.rotary_emb, *layer_ropes])}, \
            layer_ropes

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input: the token embeddings [T, hidden] (Gemma scales them)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Optional[IntermediateTensors] = None) -> Any:
        """-> hidden states [T, hidden] on the last stage, else the activations for the next stage."""
        layers = self.layers[self.start_layer:self.end_layer]
        by_rope, layer_ropes = self.rope_positions(positions, layers)  # (LongRoPE, dynamic NTK: rows per table)
        positions = by_rope[self.rotary_emb]
        # the fused stack rotates every layer at the same rows: only when no layer's table maps them otherwise
        if intermediate is None and self.fast_path is not None and all(p is positions for p in by_rope.values()):
            fused = self.fast_path(input_ids, positions)
            if fused is not None:
                return fused
        if intermediate is None:
            hidden_states = with_input_embeds(self.embed(input_ids))  # [T, hidden] (prompt embeddings put in)
            residual = None
        else:
            hidden_states, residual = intermediate.hidden_states, intermediate.residual
        if len(by_rope) == 1:
            for layer in layers:
                hidden_states, residual = layer(positions, hidden_states, residual)
        else:
            for layer, rope in zip(layers, layer_ropes):
                hidden_states, residual = layer(by_rope[rope], hidden_states, residual)
        if not self.is_last_stage:
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """The engine-facing model: forward -> hidden states, compute_logits, load_weights, attn_layers.

    Parameter names mirror HF's except the fused `qkv_proj` (q/k/v) and `gate_up_proj` (gate/up).
    """

    layer_cls: type = LlamaDecoderLayer
    model_cls: type = LlamaModel  # the decoder stack (Gemma's scales its embeddings and norms differently)
    # (our fused parameter, HF checkpoint name, shard id)
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, hf_config: Any, dtype: Optional[torch.dtype] = None, quant_config: Any = None) -> None:
        """`quant_config`: a `pagedllm.quantization.QuantizationConfig` (None: unquantized); each linear layer
        asks it for its method by prefix (`model.layers.{i}.self_attn.qkv_proj`, ...)."""
        super().__init__()
        self.config = hf_config
        self.quant_config = quant_config
        self.dtype = dtype or torch.get_default_dtype()
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.check_config(hf_config)
        with set_default_dtype(self.dtype):
            self.model = self.model_cls(hf_config, self.layer_cls, prefix="model", quant_config=quant_config)
            self.lm_head = (ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, prefix="lm_head")
                            if self.model.is_last_stage else PPMissingLayer())
        if self.tie_word_embeddings and self.model.is_first_stage and self.model.is_last_stage:
            self.lm_head.tie_weights(self.model.embed_tokens)
        # Plain list (not registered twice as submodules): the runner binds KV cache tensors through it.
        self.attn_layers: list[Attention] = [layer.self_attn.attn for layer in
                                             self.model.layers[self.model.start_layer:self.model.end_layer]]

    # Only Phi-3's transformers model rotates part of each head; the others ignore partial_rotary_factor.
    partial_rotary: bool = False

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """Refuse config features the engine does not implement or the family does not define."""
        factor = get_rope_parameters(hf_config).get("partial_rotary_factor", 1.0)
        if not cls.partial_rotary and float(factor) != 1.0:
            # transformers rotates the whole head here (its scaled ropes crash on the factor), vLLM only part of it:
            # no one answer to serve, so refuse rather than pick one silently
            raise ValueError(f"{cls.__name__}: partial_rotary_factor={factor} is not supported: transformers' model "
                             f"of this architecture does not apply it (it rotates every head dimension). Remove "
                             f"partial_rotary_factor from config.json (and from its rope_parameters / rope_scaling) "
                             f"to serve the model as transformers runs it.")

    def kv_layer_windows(self) -> list[Optional[int]]:
        """Every decoder layer's sliding window (None: full attention), including layers of other pipeline stages:
        the KV-cache groups (core/kv_cache_groups.py) are the same on every stage."""
        return [layer_sliding_window(self.config, i) for i in range(self.config.num_hidden_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Optional[IntermediateTensors] = None) -> Any:
        # input_ids, positions: [T] int64 -> hidden states [T, hidden_size] (pipeline stages: see LlamaModel)
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [N, hidden_size] -> [N, vocab_size] float32
        return self.lm_head.compute_logits(hidden_states)

    def sample_logits(self, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        """compute_logits' values in the LM head's own dtype (the widening to float32 is exact), for a sampler that
        reads them as they are; None where compute_logits does more than the LM head (a subclass's scaling or
        soft-capping): the caller then takes compute_logits."""
        if type(self).compute_logits is not LlamaForCausalLM.compute_logits:
            return None
        return self.head_logits(hidden_states)

    def head_logits(self, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        """The LM head's product in its own dtype (None: a head without one)."""
        head = getattr(self.lm_head, "_logits", None)
        return None if head is None else head(hidden_states)

    def greedy_token_ids(self, hidden_states: torch.Tensor,
                         token_bitmask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """argmax of compute_logits without materializing fp32 logits where the LM head can (CUDA; CPU fp32).

        A subclass whose compute_logits does more than the LM head (scaling, soft-capping) must override
        this too (returning None is always correct: the runner then computes full logits)."""
        return self.lm_head.greedy_token_ids(hidden_states, token_bitmask)

    def skip_weight(self, name: str) -> bool:
        tied_here = self.tie_word_embeddings and self.model.is_first_stage
        if "rotary_emb.inv_freq" in name or (tied_here and name.startswith("lm_head.")):
            return True
        return self.quant_config is not None and name.endswith(self.quant_config.skipped_checkpoint_suffixes())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of the parameters loaded (ValueError if any is missing)."""
        head: dict[str, torch.Tensor] = {}
        loaded = load_weights_into(self, stage_weights(self, self.tied_head_aside(weights, head)),
                                   self.stacked_params_mapping, skip=self.skip_weight)
        return loaded | ({"lm_head.weight"} if self.untie_if_head_differs(head) else set())

    def tied_head_aside(self, weights: Iterable[tuple[str, torch.Tensor]], head: dict[str, torch.Tensor]
                        ) -> Iterable[tuple[str, torch.Tensor]]:
        """With the head tied to the embedding, a checkpoint's own lm_head.weight is kept in `head` (for
        `untie_if_head_differs`) instead of loaded; one with no embedding loads it as the embedding (as transformers
        ties to whichever of the two the checkpoint has)."""
        weights = refuse_quantized_head(weights)
        tied = (self.model.is_first_stage and self.model.is_last_stage
                and self.lm_head.weight is self.model.embed_tokens.weight and self.lm_head.weight.numel() > 0)
        if not tied:
            yield from weights
            return
        has_embedding = False
        for name, tensor in weights:
            if name == "lm_head.weight":
                head[name] = tensor
                continue
            has_embedding = has_embedding or name == "model.embed_tokens.weight"
            yield name, tensor
        if not has_embedding and head:
            yield "model.embed_tokens.weight", head.pop("lm_head.weight")

    def untie_if_head_differs(self, head: dict[str, torch.Tensor]) -> bool:
        """A tied config whose checkpoint holds an lm_head unlike its embedding (a fine-tune that trained them
        apart, the config left as it was): transformers then does not tie them, and neither does this; tying them
        anyway would silently serve the wrong head."""
        tensor = head.get("lm_head.weight")
        if tensor is None:
            return False
        embed = self.model.embed_tokens.weight
        untied = nn.Parameter(torch.empty_like(embed), requires_grad=False)
        set_weight_attrs(untied, {"output_dim": 0, "weight_loader": self.lm_head.weight_loader})
        try:
            self.lm_head.weight_loader(untied, tensor)
        except ValueError as e:
            raise ValueError(f"Cannot load checkpoint weight 'lm_head.weight': {e}.") from None
        if torch.equal(untied, embed):
            return False
        logger.warning(UNTIED_HEAD_WARNING)
        self.lm_head.weight = untied
        self.tie_word_embeddings = False
        return True


class ScoreHead:
    """What the classifier mixins share: a `score` Linear over final hidden states (after the last norm), small and
    replicated on every tensor-parallel rank, on the last pipeline stage only (where the hidden states are); no LM
    head in the checkpoint: the config is marked tied (pooling.embedding_only), so the head the runner still builds
    reads the embedding, and only an engine-dropped token ever reads it."""

    def untie_if_head_differs(self, head: dict[str, torch.Tensor]) -> bool:
        return False  # a classifier's LM head serves only the dropped token: no second vocab-sized copy for it

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        # [N, hidden_size] -> [N, num_labels] float32 (fp32 math: a bf16 model's logits lose no more than its states)
        bias = self.score.bias
        return torch.nn.functional.linear(pooled.float(), self.score.weight.float(),
                                          None if bias is None else bias.float())

    def skip_weight(self, name: str) -> bool:
        if name.startswith("score.") and not self.model.is_last_stage:
            return True
        return super().skip_weight(name)


class SequenceClassifier(ScoreHead):
    """Mixed in before a causal class: transformers' *ForSequenceClassification (reward models, cross-encoder
    rerankers): the decoder under `model.` and a bias-free `score` Linear(hidden, num_labels) (ScoreHead).
    `classify` maps pooled last-token states to label logits (and, for token_classify, every token's)."""

    def __init__(self, hf_config: Any, dtype: Optional[torch.dtype] = None, quant_config: Any = None) -> None:
        super().__init__(hf_config, dtype, quant_config)
        self.num_labels = int(hf_config.num_labels)
        # Made from LM-head rows at load (pooling.head_from_tokens), in fp32: the two-way head is a difference of rows
        self.head_token_ids = getattr(hf_config, "pagedllm_head_token_ids", None)
        self.head_two_way = bool(getattr(hf_config, "pagedllm_head_two_way", False))
        if self.model.is_last_stage:
            self.score = nn.Linear(hf_config.hidden_size, self.num_labels, bias=False,
                                   dtype=self.dtype if self.head_token_ids is None else torch.float32)
            if self.head_token_ids is not None:
                self.score.weight.optional_weight = True  # not in the checkpoint: load_weights makes it
        else:
            self.score = PPMissingLayer()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.head_token_ids is None:
            return super().load_weights(weights)
        rows: dict[str, torch.Tensor] = {}

        def watched(stream):  # the head's rows of the tokens, from the checkpoint's whole (unsharded) tensors
            for name, tensor in stream:
                if name in ("lm_head.weight", "model.embed_tokens.weight"):
                    if not tensor.is_floating_point():
                        raise ValueError(f"classifier_from_token needs {name} unquantized, got {tensor.dtype}.")
                    rows[name] = tensor[self.head_token_ids].to(torch.float32)
                yield name, tensor

        loaded = super().load_weights(watched(weights))
        head = rows.get("lm_head.weight", rows.get("model.embed_tokens.weight"))
        if head is None:
            raise ValueError("classifier_from_token needs the checkpoint's lm_head.weight (or its tied embedding).")
        if self.model.is_last_stage:
            self.score.weight.data.copy_(head[1:] - head[:1] if self.head_two_way else head)
            loaded.add("score.weight")
        return loaded


class TokenClassifier(ScoreHead):
    """Mixed in before a causal class: transformers' *ForTokenClassification (taggers, token reward models): the
    decoder under `model.` and a `score` Linear(hidden, num_labels) with a bias (config token_classification_bias,
    true by default, as transformers) (ScoreHead). `classify` maps every token's final hidden state to label logits
    (its dropout is the identity at inference)."""

    def __init__(self, hf_config: Any, dtype: Optional[torch.dtype] = None, quant_config: Any = None) -> None:
        super().__init__(hf_config, dtype, quant_config)
        self.num_labels = int(hf_config.num_labels)
        if self.model.is_last_stage:
            self.score = nn.Linear(hf_config.hidden_size, self.num_labels, dtype=self.dtype,
                                   bias=bool(getattr(hf_config, "token_classification_bias", True)))
        else:
            self.score = PPMissingLayer()


class RewardHead(ScoreHead):
    """Mixed in before a causal class: the reward models of pooling.REWARD_MODEL_ARCHITECTURES (Qwen2.5-Math-RM /
    -PRM, remote code on the Hub): the decoder under `model.` and a two-layer `score` head, Linear(hidden, hidden) ->
    ReLU -> Linear(hidden, num_labels), both biased ("score.0.*", "score.2.*"), over every token. num_labels is the
    architecture's (1 for an outcome reward, 2 for a process reward), whatever the config says, as vLLM fixes it."""

    reward_architecture = ""  # the subclass's name in REWARD_MODEL_ARCHITECTURES

    def __init__(self, hf_config: Any, dtype: Optional[torch.dtype] = None, quant_config: Any = None) -> None:
        from pagedllm.pooling import REWARD_MODEL_ARCHITECTURES

        super().__init__(hf_config, dtype, quant_config)
        self.num_labels = REWARD_MODEL_ARCHITECTURES[self.reward_architecture][0]
        hidden = hf_config.hidden_size
        if self.model.is_last_stage:
            self.score = nn.Sequential(nn.Linear(hidden, hidden, dtype=self.dtype), nn.ReLU(),
                                       nn.Linear(hidden, self.num_labels, dtype=self.dtype))
        else:
            self.score = PPMissingLayer()

    def classify(self, states: torch.Tensor) -> torch.Tensor:
        # [N, hidden_size] -> [N, num_labels] float32: the head in fp32, as vLLM's pooling head dtype
        first, last = self.score[0], self.score[2]
        x = torch.nn.functional.linear(states.float(), first.weight.float(), first.bias.float()).relu_()
        return torch.nn.functional.linear(x, last.weight.float(), last.bias.float())


class LlamaForSequenceClassification(SequenceClassifier, LlamaForCausalLM):
    """Llama (and Mistral, same layout) with a classification head."""


class LlamaForTokenClassification(TokenClassifier, LlamaForCausalLM):
    """Llama (and Mistral, same layout) with a per-token classification head."""
