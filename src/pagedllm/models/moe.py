"""What the mixture-of-experts families share: the sparse block (router + experts + optional shared expert), a
decoder layer whose MLP is that block (or a dense MLP where the config says), and the loading of per-expert or
stacked checkpoint tensors into the experts' stacked parameters.

A family (models/mixtral.py, qwen2_moe.py, qwen3_moe.py) picks its attention class and says, per layer, what
its MLP is (`MoEDecoderLayer.moe_spec`); the rest (embedding, rope, norms, LM head, pipeline stages, the KV
cache binding) is the Llama stack.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import types
from typing import Any, Iterable, Optional

import torch
from torch import nn

from pagedllm.distributed.pipeline import stage_weights
from pagedllm.layers.activation import triton_kernels
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.layernorm import is_plain_rms_norm
from pagedllm.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, layer_index
from pagedllm.models.weight_utils import load_weights_into

logger = logging.getLogger(__name__)

# model.layers.3.mlp.experts.7.w1.weight (hub Mixtral), ...experts.7.gate_proj.weight (hub Qwen)
_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj|"
                         r"gate_up_proj)\.weight$")
# ...experts.gate_up_proj / ...experts.down_proj (transformers 5), ...experts.gate_proj.weight (GGUF, stacked)
_STACKED = re.compile(r"^(?P<module>.+\.experts)\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")
_SHARD_OF = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down",
             "gate_up_proj": "gate_up"}


def describe_checkpoint_quantization(qc: dict[str, Any]) -> str:
    """'gptq (4-bit, group size 128)' and the like, from a checkpoint's quantization_config, for messages."""
    method = str(qc.get("quant_method") or "an unnamed method")
    details = []
    if qc.get("bits") or qc.get("w_bit"):
        details.append(f"{qc.get('bits') or qc.get('w_bit')}-bit")
    if qc.get("group_size") or qc.get("q_group_size"):
        details.append(f"group size {qc.get('group_size') or qc.get('q_group_size')}")
    if qc.get("weight_block_size"):
        details.append(f"weight blocks {qc['weight_block_size']}")
    if qc.get("format") and method == "compressed-tensors":
        details.append(f"format {qc['format']}")
    return method + (f" ({', '.join(details)})" if details else "")


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """One layer's sparse MLP, read from the config by the family."""
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # divide the top-k probabilities by their sum
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, sigmoid-gated


def expert_target(name: str) -> Optional[tuple[str, str, Optional[int]]]:
    """(experts module name, shard, expert id or None for stacked) of a checkpoint tensor name, else None."""
    match = _PER_EXPERT.match(name)
    if match is not None:
        return match["module"], _SHARD_OF[match["proj"]], int(match["expert"])
    match = _STACKED.match(name)
    if match is not None:
        return match["module"], _SHARD_OF[match["proj"]], None
    return None


# Few-row CUDA steps: the router's logits come from the post-attention norm's kernel (kernels/norm.rms_norm_shrink
# with the router's weight as its projection), one launch less per MoE layer. False: the router's own GEMV (the
# A/B: benchmarks/moe_variants/ab.py --norm-router).
NORM_ROUTER = True
NORM_ROUTER_MAX_ROWS = 8
_ZERO_SLOTS: dict = {}  # device -> int32 zeros: every row's "adapter slot" 0, the router's weight


def _zero_slots(device: torch.device) -> Optional[torch.Tensor]:
    """Made outside any CUDA-graph capture (a capture records the fill without running it); None while one runs
    before the first eager use (the router then runs alone)."""
    slots = _ZERO_SLOTS.get(device)
    if slots is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        slots = _ZERO_SLOTS[device] = torch.zeros(NORM_ROUTER_MAX_ROWS, dtype=torch.int32, device=device)
    return slots


class SparseMoeBlock(nn.Module):
    """x -> sum over the top-k experts of p_e * expert_e(x) (+ sigmoid(g . x) * shared_expert(x))."""

    def __init__(self, config: Any, spec: MoESpec, prefix: str, quant_config: Any = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = ReplicatedLinear(hidden, spec.num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(spec.num_experts, spec.top_k, hidden, spec.intermediate_size, spec.renormalize,
                                prefix=f"{prefix}.experts")
        self.shared_expert: Optional[LlamaMLP] = None
        self.shared_expert_gate: Optional[ReplicatedLinear] = None
        if spec.shared_expert_intermediate_size:
            shared = types.SimpleNamespace(hidden_size=hidden, hidden_act=config.hidden_act, mlp_bias=False,
                                           intermediate_size=spec.shared_expert_intermediate_size)
            self.shared_expert = LlamaMLP(shared, prefix=f"{prefix}.shared_expert", quant_config=quant_config)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False, prefix=f"{prefix}.shared_expert_gate")

        self._pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def norm_and_shrink(self, norm: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor]):
        """`norm(x, residual)` (the post-attention RMSNorm, whose output is this block's input alone) with the
        router's logits computed by the same kernel on few-row steps (NORM_ROUTER; the norm calls this on CUDA);
        None where that does not apply (the norm then runs alone and `forward` runs the router)."""
        gate = self.gate
        w = gate.weight
        if not (NORM_ROUTER and x.dim() == 2 and 0 < x.shape[0] <= NORM_ROUTER_MAX_ROWS
                and (residual is None or residual.shape == x.shape) and gate.bias is None
                and type(gate.linear_method) is UnquantizedLinearMethod and w.dtype == x.dtype == norm.weight.dtype
                and w.is_contiguous() and w.shape[1] == x.shape[1]):
            return None
        kernels = triton_kernels("norm")
        slots = _zero_slots(x.device) if kernels is not None else None
        if slots is None:
            return None
        out, new_residual, logits = kernels.rms_norm_shrink(x, residual, norm.weight, norm.variance_epsilon,
                                                            norm.fp32_product, w[None], slots, h_dtype=x.dtype)
        self._pending = (out, logits[0])
        return out if residual is None else (out, new_residual)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, hidden] -> [T, hidden]; router logits [T, E] in the model dtype (as transformers): the norm's kernel
        # computed them for this very x, else the router's GEMV
        pending, self._pending = self._pending, None
        logits = pending[1] if pending is not None and pending[0] is x else self.gate(x)
        out = self.experts(x, logits)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoEDecoderLayer(LlamaDecoderLayer):
    """The Llama layer (same forward: fused residual norms) with `moe_spec`'s MLP."""

    def __init__(self, config: Any, rotary_emb: Any, prefix: str = "", quant_config: Any = None) -> None:
        super().__init__(config, rotary_emb, prefix=prefix, quant_config=quant_config)
        if isinstance(self.mlp, SparseMoeBlock) and is_plain_rms_norm(self.post_attention_layernorm):
            # a plain reference, not a submodule of the norm
            self.post_attention_layernorm.__dict__["shrink_consumer"] = self.mlp

    def build_mlp(self, config: Any, prefix: str, quant_config: Any) -> nn.Module:
        spec = self.moe_spec(config, layer_index(prefix))
        if spec is None:
            return super().build_mlp(config, prefix, quant_config)  # a dense layer: LlamaMLP
        return SparseMoeBlock(config, spec, prefix, quant_config)

    @classmethod
    def moe_spec(cls, config: Any, index: int) -> Optional[MoESpec]:
        """Layer `index`'s sparse MLP, or None for a dense one (config.intermediate_size)."""
        raise NotImplementedError


class MoEForCausalLM(LlamaForCausalLM):
    """Loads experts from per-expert or stacked checkpoint tensors; everything else as Llama."""

    layer_cls: type = MoEDecoderLayer
    # (old, new) substrings of checkpoint names, applied first (Mixtral's hub `block_sparse_moe` -> `mlp`)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, hf_config: Any, dtype: Optional[torch.dtype] = None, quant_config: Any = None) -> None:
        if quant_config is not None and not getattr(quant_config, "online", False):
            # the loader refuses such checkpoints first (refuse_checkpoint_quantization); this guards direct builds
            raise ValueError(self.quantization_refusal(getattr(hf_config, "name_or_path", "") or "the model",
                                                       {"quant_method": quant_config.name}))
        if quant_config is not None:
            logger.info("%s: --quantization %s quantizes the attention (and dense MLP) layers; the experts and "
                        "routers stay in %s (no quantized expert kernels yet).", type(self).__name__,
                        quant_config.name, str(dtype or torch.get_default_dtype()).replace("torch.", ""))
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{type(self).__name__}: experts with hidden_act={act!r} are not supported; the fused "
                             f"MoE layer implements SiLU experts.")
        super().__init__(hf_config, dtype, quant_config)

    @classmethod
    def quantization_refusal(cls, model: str, checkpoint_quant: dict[str, Any]) -> str:
        return (f"{model} ({cls.__name__}) is a mixture-of-experts checkpoint quantized with "
                f"{describe_checkpoint_quantization(checkpoint_quant)}, which pagedllm cannot load yet: its "
                f"experts have no quantized kernels; use the float (bf16/fp16) checkpoint, optionally with online "
                f"--quantization fp8 or int8 (attention quantized, experts kept in --dtype), or a GGUF of the model "
                f"(its experts are dequantized at load).")

    @classmethod
    def refuse_checkpoint_quantization(cls, model: str, checkpoint_quant: dict[str, Any]) -> None:
        """Called by the loader before anything is built, with the checkpoint's quantization_config: no
        quantized format reaches the experts' float loaders (they would crash on qweight / scales or load
        wrong values)."""
        raise ValueError(cls.quantization_refusal(model, checkpoint_quant))

    def expert_modules(self) -> dict[str, FusedMoE]:
        return {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts = self.expert_modules()

        def non_expert(stream: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in stream:
                for old, new in self.checkpoint_renames:
                    name = name.replace(old, new)
                target = expert_target(name)
                module = experts.get(target[0]) if target is not None else None
                if module is None:
                    yield name, tensor
                    continue
                _, shard, expert_id = target
                param = module.down_proj if shard == "down" else module.gate_up_proj
                try:
                    module.weight_loader(param, tensor, shard, expert_id)
                except ValueError as e:
                    raise ValueError(f"Cannot load checkpoint weight {name!r}: {e}.") from None

        expert_params = {f"{name}.{p}" for name in experts for p in ("gate_up_proj", "down_proj")}
        head: dict[str, torch.Tensor] = {}
        loaded = load_weights_into(self, non_expert(stage_weights(self, self.tied_head_aside(weights, head))),
                                   self.stacked_params_mapping, skip=self.skip_weight, loaded_elsewhere=expert_params)
        if self.untie_if_head_differs(head):
            loaded.add("lm_head.weight")
        missing = [f"{name} {shard}" for name, module in experts.items() for shard in module.missing_shards()]
        if missing:
            shown = ", ".join(missing[:8]) + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
            raise ValueError(f"The checkpoint is missing {len(missing)} expert weight(s) the model needs: {shown}.")
        return loaded | expert_params
