"""Pipeline parallelism: which layers a stage holds, placeholders for the others, and the stage wrapper that
moves activations between stages.

A model split into P stages keeps every layer index (so checkpoint names still match) but builds only its
own range; the rest are `PPMissingLayer`s without parameters. The first stage embeds, the last one holds the
final norm and the LM head. Between stages travel the hidden states and the residual stream of every token
of the step ([T, hidden] each), over the pipeline group's collective backend (gloo on CPU, NCCL on GPU).
Every stage runs the same BatchPlan, so each knows T without asking.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_pp_group

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class PPMissingLayer(nn.Identity):
    """Stands in for a layer (or embedding / norm / head) another pipeline stage holds."""


@dataclass
class IntermediateTensors:
    hidden_states: torch.Tensor  # [T, hidden]
    residual: torch.Tensor  # [T, hidden]


def stage_layer_range(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """[start, end) of the layers of `stage`: as even as possible, earlier stages take the remainder (the last
    stage also runs the LM head)."""
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size={num_stages} is larger than the model's {num_layers} layers; "
                         f"use at most {num_layers} stages.")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


def stage_weights(model: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Only the checkpoint tensors this stage holds. A tied LM head on a last stage that has no embedding loads
    the embedding's tensor into its own copy."""
    pp = get_pp_group()
    if pp.world_size == 1:
        yield from weights
        return
    start, end = model.model.start_layer, model.model.end_layer
    first, last = pp.is_first_rank, pp.is_last_rank
    tied_copy = model.tie_word_embeddings and last and not first
    num_layers = model.config.num_hidden_layers
    for name, tensor in weights:
        match = _LAYER_RE.search(name)
        if match is not None:
            index = int(match.group(1))
            # A layer no stage holds (a checkpoint with more layers than the config) reaches the last stage's
            # loader, which reports it: dropped here it would go unnoticed.
            if start <= index < end or (last and index >= num_layers):
                yield name, tensor
            continue
        if "embed_tokens." in name:
            if first:
                yield name, tensor
            if tied_copy:
                yield name.replace("model.embed_tokens.", "lm_head."), tensor
        elif name.startswith("lm_head."):
            if last and not model.tie_word_embeddings:
                yield name, tensor
        elif name.startswith("model.norm."):
            if last:
                yield name, tensor
        else:
            yield name, tensor


class PipelineStage(nn.Module):
    """Wraps a causal LM for one pipeline stage: receive the previous stage's activations, run this stage's
    layers, send them on. `forward` returns the final hidden states on the last stage and None elsewhere."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.attn_layers = model.attn_layers
        self.hidden_size = model.config.hidden_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        pp = get_pp_group()
        intermediate = None
        if not pp.is_first_rank:
            shape = (input_ids.shape[0], self.hidden_size)
            dtype, device = self.inner.dtype, input_ids.device
            prev = pp.rank_in_group - 1
            hidden = pp.recv(shape, dtype, device, prev)
            intermediate = IntermediateTensors(hidden, pp.recv(shape, dtype, device, prev))
        out = self.inner(input_ids, positions, intermediate)
        if pp.is_last_rank:
            return out
        nxt = pp.rank_in_group + 1
        pp.send(out.hidden_states, nxt)
        pp.send(out.residual, nxt)
        return None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden_states)

    def greedy_token_ids(self, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        return self.inner.greedy_token_ids(hidden_states)

    @property
    def lm_head(self) -> Any:
        head = getattr(self.inner, "lm_head", None)
        return None if isinstance(head, PPMissingLayer) else head
