"""HostStager's packing: each staged array starts 64-byte aligned, so device pointers never change alignment
with the batch size (Triton would compile a new kernel variant for each alignment)."""
import numpy as np
import torch

from pagedllm.worker.model_runner import HostStager


def test_layout_aligns_every_array_to_64_bytes():
    for dtype, itemsize in ((np.int32, 4), (np.int64, 8)):
        arrays = [np.arange(n, dtype=dtype) for n in (5, 1, 17, 0, 64, 3)]
        offsets = HostStager.layout(arrays, dtype)
        assert len(offsets) == len(arrays) + 1
        for a, start, end in zip(arrays, offsets, offsets[1:]):
            assert (start * itemsize) % 64 == 0
            assert end - start >= a.size
        assert offsets[-1] * itemsize % 64 == 0


def test_layout_batch_size_does_not_move_alignment():
    # query_start_loc has num_reqs + 1 entries: what follows it must stay aligned for every batch size.
    for num_reqs in range(1, 40):
        qsl, seq_lens = np.zeros(num_reqs + 1, np.int32), np.zeros(num_reqs, np.int32)
        offsets = HostStager.layout([qsl, seq_lens, np.zeros((num_reqs, 7), np.int32)], np.int32)
        assert all(o * 4 % 64 == 0 for o in offsets)


def test_cpu_stage_returns_the_arrays():
    stager = HostStager(torch.device("cpu"))
    a, b = np.array([1, 2, 3]), np.array([[4, 5], [6, 7]])
    ta, tb = stager.stage([a, b], np.int64)
    assert ta.tolist() == [1, 2, 3] and tb.tolist() == [[4, 5], [6, 7]] and ta.dtype == torch.int64


def test_views_of_the_packed_buffer():
    arrays = [np.arange(5), np.arange(6).reshape(2, 3), np.zeros(0, np.int64), np.arange(9) + 100,
              np.arange(8).reshape(4, 2) + 50]
    offsets = HostStager.layout(arrays, np.int64)
    packed = torch.full((offsets[-1],), -1, dtype=torch.int64)
    for a, start in zip(arrays, offsets):
        packed[start:start + a.size] = torch.from_numpy(a.reshape(-1))
    views = HostStager.views(packed, arrays, offsets)
    assert [v.tolist() for v in views] == [a.tolist() for a in arrays]
    assert all(v.data_ptr() == packed.data_ptr() + 8 * start for v, start in zip(views, offsets) if v.numel())
