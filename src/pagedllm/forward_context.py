"""The one global: what the attention layers of the model being run need to know about the batch.

The model runner sets it around each forward with `set_forward_context(...)`; `Attention` layers read it.
Outside a forward (e.g. memory profiling, weight loading) it is None and attention runs without a cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch


@dataclass
class AttentionMetadata:
    """Describes one flattened batch: requests' new tokens laid end to end.

    Rows i covers tokens query_start_loc[i]:query_start_loc[i+1]; those are the last query_len tokens
    of a context of seq_lens[i] tokens whose K/V (after this step's write) live in the blocks
    block_table[i, :ceil(seq_lens[i] / block_size)].
    """

    num_actual_tokens: int  # real tokens (the rest of the input, if any, is CUDA-graph padding)
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat slot (block_id * block_size + offset) per token
    # Pure-decode steps, for backends with `wants_decode_order`: [num_reqs] int32, the rows sorted by seq_lens,
    # longest first (a scheduling hint for the decode kernel; any permutation gives the same result).
    decode_order: Optional[torch.Tensor] = None
    # Host copies for backends that plan on the CPU (the torch backend); never read in CUDA graphs.
    query_start_loc_cpu: Optional[list[int]] = None
    seq_lens_cpu: Optional[list[int]] = None
    # Mixed-step CUDA graphs: the prefill kernel's query tile, fixed at capture (the eager launch picks it from
    # max_query_len, which a graph cannot follow). None outside such graphs.
    graph_prefill_tile: Optional[int] = None
    # Backend-specific extras (e.g. split-KV workspace) may be attached here.
    extra: Any = None
    # Several KV-cache groups (core/kv_cache_groups.py): per group the same batch with that group's block_table
    # and slot_mapping (index 0: this object). An `Attention` layer of group g attends with kv_groups[g].
    kv_groups: Optional[list["AttentionMetadata"]] = None

    def for_group(self, group: int) -> "AttentionMetadata":
        return self if group == 0 or self.kv_groups is None else self.kv_groups[group]


def with_kv_groups(metadata: AttentionMetadata, block_tables, slot_mappings) -> AttentionMetadata:
    """Attach groups 1..'s metadata (their block tables and slot mappings) to group 0's; returns metadata."""
    if block_tables:
        metadata.kv_groups = [metadata] + [
            dataclasses.replace(metadata, block_table=table, slot_mapping=slots, kv_groups=None)
            for table, slots in zip(block_tables, slot_mappings)]
    return metadata


@dataclass
class ForwardContext:
    attn_metadata: Optional[AttentionMetadata]
    attn_backend: Any  # pagedllm.attention.backend.AttentionBackend
    # This step sets each FP8-cache layer's k/v scales from its K/V (layers/kv_cache_scales.py) before writing.
    calibrate_kv: bool = False
    # Prompts given as embeddings: (flat token indices [k] int64, rows [k, hidden]) that replace the embedding
    # lookup's output at those tokens (layers/vocab_embedding.py). None: every token is looked up.
    input_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None


_context: Optional[ForwardContext] = None


def get_forward_context() -> Optional[ForwardContext]:
    return _context


def with_input_embeds(hidden: torch.Tensor) -> torch.Tensor:
    """The model's input embeddings [T, hidden] with the rows a prompt gave as embeddings put in (vLLM's prompt_embeds
    stand for the model's input embeddings, Gemma's scaling included, as transformers' inputs_embeds do)."""
    if _context is None or _context.input_embeds is None:
        return hidden
    index, rows = _context.input_embeds
    return hidden.index_copy(0, index, rows.to(hidden.dtype))


@contextlib.contextmanager
def set_forward_context(attn_metadata: Optional[AttentionMetadata], attn_backend: Any,
                        calibrate_kv: bool = False, input_embeds: Optional[tuple] = None) -> Iterator[None]:
    global _context
    previous = _context
    _context = ForwardContext(attn_metadata=attn_metadata, attn_backend=attn_backend, calibrate_kv=calibrate_kv,
                              input_embeds=input_embeds)
    try:
        yield
    finally:
        _context = previous
