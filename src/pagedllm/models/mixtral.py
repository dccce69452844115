"""Mixtral (8x7B, 8x22B): Llama attention, every layer's MLP a sparse block of `num_local_experts` SiLU experts,
`num_experts_per_tok` of them per token, their softmax probabilities always renormalized over the chosen ones.

Hub checkpoints name the block `block_sparse_moe` (router `gate`, experts `experts.N.w1/w3/w2` = gate/up/down);
transformers 5 names it `mlp` with stacked `experts.gate_up_proj` / `experts.down_proj`: both load.
"""
from __future__ import annotations

from typing import Any, Optional

from pagedllm.models.moe import MoEDecoderLayer, MoEForCausalLM, MoESpec


class MixtralDecoderLayer(MoEDecoderLayer):
    @classmethod
    def moe_spec(cls, config: Any, index: int) -> Optional[MoESpec]:
        return MoESpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                       intermediate_size=config.intermediate_size, renormalize=True)


class MixtralForCausalLM(MoEForCausalLM):
    layer_cls = MixtralDecoderLayer
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)
