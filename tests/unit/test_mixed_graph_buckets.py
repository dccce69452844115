"""Host side of the mixed-step CUDA graphs: token buckets and padding (CPU)."""
from __future__ import annotations

import torch

import numpy as np

from pagedllm.worker.mixed_graph import bucket_for, mixed_capture_sizes, pick_tile


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


def _graph_inputs(num_kv_groups=1):
    from types import SimpleNamespace

    from pagedllm.worker.mixed_graph import GraphInputs

    runner = SimpleNamespace(device=torch.device("cpu"), scratch_block=50, block_size=4, max_blocks_per_req=6,
                             num_kv_groups=num_kv_groups)
    return GraphInputs(runner, max_tokens=16, max_reqs=4)


def _step(num_tokens, query_lens, seed, staged=False):
    """(token ids, positions, metadata) of a step; staged: the three token arrays one after another in one buffer,
    64-byte aligned, as the runner's host stager lays them out (GraphInputs then copies them at once)."""
    from pagedllm.forward_context import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (num_tokens,), generator=g)
    slots = torch.randint(0, 160, (num_tokens,), generator=g)
    pos = ids + 1
    if staged:
        stride = -(-num_tokens // 8) * 8
        packed = torch.full((3 * stride,), -1, dtype=torch.long)
        views = [packed[i * stride:i * stride + num_tokens] for i in range(3)]
        for view, values in zip(views, (ids, pos, slots)):
            view.copy_(values)
        ids, pos, slots = views
    qsl = torch.tensor([0] + list(np.cumsum(query_lens)), dtype=torch.int32)
    md = AttentionMetadata(num_actual_tokens=num_tokens, num_reqs=len(query_lens), max_query_len=max(query_lens),
                           max_seq_len=32, query_start_loc=qsl,
                           seq_lens=torch.tensor([q + 7 for q in query_lens], dtype=torch.int32),
                           block_table=torch.randint(0, 40, (len(query_lens), 2), generator=g, dtype=torch.int32),
                           slot_mapping=slots)
    return ids, pos, md


def test_padding_rows_point_at_the_scratch_slot_whatever_came_before():
    """Padding (tokens past the step: token 0, position 0, the scratch slot; request rows past it: no query tokens)
    is right after loads of other layouts, and a load laid out as the one before launches no fill; the token arrays
    staged in one buffer come in with one copy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Fills(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Fills.count += "fill" in str(func)
            return func(*args, **(kwargs or {}))

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.count += "copy_" in str(func)
            return func(*args, **(kwargs or {}))

    inputs = _graph_inputs()
    layouts = [(5, [5]), (3, [2, 1]), (8, [4, 4]), (5, [5]), (5, [5]), (3, [2, 1])]
    for staged in (False, True):
        inputs.forget_padding()
        for i, (n, qlens) in enumerate(layouts):
            ids, pos, md = _step(n, qlens, i + 10 * staged, staged)
            Fills.count = Copies.count = 0
            with Fills(), Copies():
                inputs.load(ids, pos, md, 8, 4)
            repeated = i > 0 and layouts[i - 1] == (n, qlens)
            assert (Fills.count == 0) == repeated
            # token ids, positions and slots: one copy staged, three apart (+ query starts, lengths, the table)
            assert Copies.count == (1 if staged else 3) + 3
            assert inputs.input_ids[:8].tolist() == ids.tolist() + [0] * (8 - n)
            assert inputs.positions[:8].tolist() == pos.tolist() + [0] * (8 - n)
            assert inputs.slot_mapping[:8].tolist() == md.slot_mapping.tolist() + [50 * 4] * (8 - n)
            assert inputs.query_start_loc[:5].tolist() == md.query_start_loc.tolist() + [n] * (4 - len(qlens))
            assert inputs.seq_lens[:4].tolist() == md.seq_lens.tolist() + [0] * (4 - len(qlens))
            assert inputs.input_ids[8:].tolist() == [0] * 8  # beyond the bucket: untouched


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
    from pagedllm.forward_context import AttentionMetadata, with_kv_groups

    inputs = _graph_inputs(num_kv_groups=3)
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
