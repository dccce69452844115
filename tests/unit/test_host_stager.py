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



def test_packed_stage_returns_aligned_views_of_the_arrays():
    """The packed path (CUDA's; here on a pageable CPU buffer): every array comes back with its shape and values, at
    a 64-byte aligned offset of one buffer, whatever the mix of sizes (empty, 2-D, one element)."""
    stager = HostStager(torch.device("cpu"))
    stager.packed = True
    rng = np.random.default_rng(0)
    for step in range(6):
        arrays = [rng.integers(-50, 50, size=shape) for shape in
                  [(int(rng.integers(0, 9)),), (1,), (0,), (int(rng.integers(1, 4)), 7), (int(rng.integers(1, 30)),)]]
        for dtype in (np.int64, np.int32):
            staged = stager.stage(arrays, dtype)
            base = staged[0].untyped_storage().data_ptr()
            for a, t in zip(arrays, staged):
                assert tuple(t.shape) == a.shape and t.dtype == torch.from_numpy(np.zeros(1, dtype)).dtype
                assert t.tolist() == a.tolist(), (step, a, t)
                assert t.untyped_storage().data_ptr() == base
                assert a.size == 0 or (t.data_ptr() - base) % 64 == 0  # (an empty tensor's data_ptr is 0)
        stager.next_step()


def test_stage_in_keeps_each_slot_until_it_is_staged_again():
    """stage_in(i, ...) (the draft model's: one slot per staging of a proposal): slots past the two of stage() are
    added; staging into one slot leaves every other slot's arrays as they were."""
    stager = HostStager(torch.device("cpu"))
    stager.packed = True  # (views of the host buffer here, so a rewritten slot shows in its earlier views)
    staged = [stager.stage_in(i, [np.full(5 + i, 10 * i), np.full((2, 3), i)], np.int64) for i in range(5)]
    assert len(stager.slots) == 5
    for i, (a, b) in enumerate(staged):
        assert a.tolist() == [10 * i] * (5 + i) and b.tolist() == [[i] * 3] * 2
    again = stager.stage_in(2, [np.full(7, -1), np.full((2, 3), -1)], np.int64)
    assert staged[2][0].data_ptr() == again[0].data_ptr()  # slot 2's buffer, rewritten
    for i in (0, 1, 3, 4):
        assert staged[i][0].tolist() == [10 * i] * (5 + i)
