"""The persistent device inputs that captured mixed-step and speculative verify graphs read (worker/mixed_graph.py,
worker/verify_graph.py): one set per runner, sized for both, since no two graphs replay at once.

Before a replay, `load` copies a step's inputs into the head of each buffer (device copies, no host sync) and
fills the rest with padding that is harmless real work: padding tokens carry token 0 at position 0 and write their
K/V into the scratch block; request rows past the step's have no query tokens (their query_start_loc entries
repeat the token count) and seq_len 0, so their attention programs exit at once.
"""
from __future__ import annotations

import torch

from pagedllm.forward_context import AttentionMetadata


def pad_rows(static: torch.Tensor, values: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    """Copy `values` into the head of `static` and `fill` the rest up to `size`; returns static[:size]."""
    n = values.shape[0]
    static[:n].copy_(values, non_blocking=True)
    if size > n:
        static[n:size].fill_(fill)
    return static[:size]


class GraphInputs:
    """Static buffers for steps of up to `max_tokens` tokens and `max_reqs` requests (see the module docstring)."""

    def __init__(self, runner, max_tokens: int, max_reqs: int) -> None:
        dev = runner.device
        self.max_tokens, self.max_reqs = max(max_tokens, 1), max(max_reqs, 1)
        self.scratch_slot = runner.scratch_block * runner.block_size
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((self.max_tokens,), self.scratch_slot, dtype=torch.long, device=dev)
        self.query_start_loc = torch.zeros(self.max_reqs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(self.max_reqs, dtype=torch.int32, device=dev)
        self.block_table = torch.full((self.max_reqs, runner.max_blocks_per_req), runner.scratch_block,
                                      dtype=torch.int32, device=dev)

    def metadata(self, tokens: int, reqs: int, max_query_len: int, max_seq_len: int,
                 graph_prefill_tile=None) -> AttentionMetadata:
        """The metadata a graph is captured with: views of the static buffers."""
        return AttentionMetadata(
            num_actual_tokens=tokens, num_reqs=reqs, max_query_len=max_query_len, max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[:reqs + 1], seq_lens=self.seq_lens[:reqs],
            block_table=self.block_table[:reqs], slot_mapping=self.slot_mapping[:tokens],
            graph_prefill_tile=graph_prefill_tile)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, tokens: int,
             reqs: int) -> None:
        """A step's inputs into the buffers, padded to `tokens` tokens and `reqs` request rows."""
        n = input_ids.shape[0]
        pad_rows(self.input_ids, input_ids, tokens, 0)
        pad_rows(self.positions, positions, tokens, 0)
        pad_rows(self.slot_mapping, md.slot_mapping, tokens, self.scratch_slot)
        pad_rows(self.query_start_loc, md.query_start_loc, reqs + 1, n)  # padding rows: no query tokens
        pad_rows(self.seq_lens, md.seq_lens, reqs, 0)
        nb = md.block_table.shape[1]
        self.block_table[:md.num_reqs, :nb].copy_(md.block_table, non_blocking=True)
