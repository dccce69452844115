"""Pipeline parallelism: which layers a stage holds, placeholders for the others, and the stage wrapper that
moves activations between stages.

A model split into P stages keeps every layer index (so checkpoint names still match) but builds only its
own range; the rest are `PPMissingLayer`s without parameters. The first stage embeds, the last one holds the
final norm and the LM head. Between stages travel the hidden states and the residual stream of every token
of the step ([T, hidden] each), over the pipeline group's collective backend (gloo on CPU, NCCL on GPU).
Every stage runs the same BatchPlan, so each knows T without asking.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_pp_group

logger = logging.getLogger(__name__)

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


UNTIED_HEAD_WARNING = ("config.json sets tie_word_embeddings, but the checkpoint's lm_head.weight differs from "
                       "model.embed_tokens.weight: the LM head is not tied and uses the checkpoint's lm_head (as "
                       "transformers does); set tie_word_embeddings to false to silence this warning.")


def stage_weights(model: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Only the checkpoint tensors this stage holds.

    A tied LM head on a last stage without the embedding loads its own copy: the checkpoint's lm_head.weight
    when it has one (a head trained apart from the embedding under a tied config is what transformers serves,
    untied, as one rank does: `untie_if_head_differs`), else the embedding's tensor. A tied first stage without
    the head loads lm_head.weight as its embedding when the checkpoint has no embedding (transformers ties to
    whichever of the two the checkpoint has)."""
    pp = get_pp_group()
    if pp.world_size == 1:
        yield from weights
        return
    start, end = model.model.start_layer, model.model.end_layer
    first, last = pp.is_first_rank, pp.is_last_rank
    tied = model.tie_word_embeddings
    tied_copy = tied and last and not first
    num_layers = model.config.num_hidden_layers
    # Held to the end of the stream: which of the two feeds the other stage's side is known only then.
    embed: Optional[tuple[str, torch.Tensor]] = None
    head: Optional[tuple[str, torch.Tensor]] = None
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
            embed = (name, tensor)
        elif name.startswith("lm_head."):
            if last and not tied:
                yield name, tensor
            head = (name, tensor)
        elif name.startswith("model.norm."):
            if last:
                yield name, tensor
        else:
            yield name, tensor
    if tied_copy:
        if head is not None:
            if embed is not None and not torch.equal(head[1], embed[1]):
                logger.warning(UNTIED_HEAD_WARNING)
            yield head
        elif embed is not None:
            yield embed[0].replace("model.embed_tokens.", "lm_head."), embed[1]
    elif tied and first and not last and embed is None and head is not None:
        yield head[0].replace("lm_head.", "model.embed_tokens."), head[1]


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
