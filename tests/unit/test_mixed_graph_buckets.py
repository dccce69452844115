"""Host side of the mixed-step CUDA graphs: token buckets and padding (CPU)."""
from __future__ import annotations

import torch

import numpy as np

from pagedllm.worker.mixed_graph import bucket_for, mixed_capture_sizes, pad_rows, pick_tile


def test_buckets_end_at_the_budget_and_cover_every_count():
    sizes = mixed_capture_sizes(1000)
    assert sizes[-1] == 1000 and sizes == sorted(set(sizes)) and sizes[0] == 16
    for n in range(1, 1001):
        b = bucket_for(sizes, n)
        assert b >= n and all(s < n for s in sizes if s < b)
    assert bucket_for(sizes, 1001) is None
    assert mixed_capture_sizes(8) == [8]
    # padding stays a small fraction of large steps
    assert all(bucket_for(mixed_capture_sizes(8192), n) <= 1.25 * n for n in range(256, 8193))


def test_padding_rows_point_at_the_scratch_slot():
    static = torch.full((16,), 7, dtype=torch.long)
    out = pad_rows(static, torch.tensor([3, 4, 5]), 8, fill=99)
    assert out.tolist() == [3, 4, 5, 99, 99, 99, 99, 99]
    assert static[8:].tolist() == [7] * 8  # beyond the bucket: untouched


def test_tile_choice_follows_the_step():
    tiles = [16, 128]
    decodes = np.ones(200, dtype=np.int64)
    contexts = np.full(200, 300)
    assert pick_tile(tiles, 2, decodes, contexts) == 16  # decode rows: tall tiles waste their rows
    long_chunk = np.array([4096])
    assert pick_tile(tiles, 2, long_chunk, long_chunk) == 128  # one long prefill: short tiles re-read the context
    assert pick_tile([64], 2, decodes, contexts) == 64


def test_graph_inputs_keep_a_table_and_slot_mapping_per_kv_group():
    """Several KV-cache groups (sliding windows): the static buffers hold each group's table and slots, and the
    metadata a graph is captured with reads them through kv_groups."""
    from types import SimpleNamespace

    from pagedllm.forward_context import AttentionMetadata, with_kv_groups
    from pagedllm.worker.mixed_graph import GraphInputs

    runner = SimpleNamespace(device=torch.device("cpu"), scratch_block=50, block_size=4, max_blocks_per_req=6,
                             num_kv_groups=3)
    inputs = GraphInputs(runner, max_tokens=16, max_reqs=4)
    captured = inputs.metadata(8, 3, 8, 24)
    assert len(captured.kv_groups) == 3 and captured.for_group(2).block_table.data_ptr() == \
        inputs.block_tables[2].data_ptr()
    tables = [torch.tensor([[g * 10 + 1, g * 10 + 2], [g * 10 + 3, g * 10 + 4]], dtype=torch.int32) for g in range(3)]
    slots = [torch.arange(5, dtype=torch.long) + 100 * g for g in range(3)]
    md = AttentionMetadata(num_actual_tokens=5, num_reqs=2, max_query_len=4, max_seq_len=8,
                           query_start_loc=torch.tensor([0, 4, 5], dtype=torch.int32),
                           seq_lens=torch.tensor([8, 5], dtype=torch.int32), block_table=tables[0],
                           slot_mapping=slots[0])
    with_kv_groups(md, tables[1:], slots[1:])
    inputs.load(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long), md, 8, 3)
    for g in range(3):
        group = captured.for_group(g)
        assert group.block_table[:2, :2].tolist() == tables[g].tolist()
        assert group.slot_mapping.tolist() == slots[g].tolist() + [50 * 4] * 3  # padding: the scratch slot
