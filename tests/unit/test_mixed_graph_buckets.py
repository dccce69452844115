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
