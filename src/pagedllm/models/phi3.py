"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): the Llama layout, with

  * checkpoints that store q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` ([gate; up] rows): the
    fused layers' loaders split them into their shards (tensor parallelism included), so nothing here renames;
  * LongRoPE ("longrope", the older "su"): short and long per-frequency factors around
    original_max_position_embeddings and the attention factor on cos/sin (layers/rotary_embedding.py);
  * partial rotary (Phi-4-mini: partial_rotary_factor 0.75, the first 96 of 128 dims rotated);
  * `sliding_window` on every layer when the config sets it (Phi-3-mini-4k: 2047), as transformers applies it.
"""
from __future__ import annotations

from pagedllm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM reads Phi-3's checkpoints as they are: `qkv_proj` / `gate_up_proj` match our fused
    parameters by name and load through their unsplit path (shard_id None). `stacked_params_mapping` still names
    q/k/v and gate/up for checkpoints (GGUF conversions, adapters) that store them apart."""

    partial_rotary = True  # Phi-4-mini rotates the first 3/4 of each head
