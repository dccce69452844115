"""kernels/qgemv_mma._launch_pdl's argument block on the CPU: what cuLaunchKernelEx would receive (a stand-in reads
the launch config and every argument slot back through their addresses), over launches that reuse the block with
other arguments, other argument counts and other streams. The GPU tests launch the real kernels through it."""
from __future__ import annotations

import ctypes
import types

import torch

from pagedllm.kernels import qgemv_mma


def test_launch_pdl_passes_grid_block_stream_pdl_and_every_argument(monkeypatch):
    seen = []

    def fake_launch(cfg_addr, func, params_addr, extra):
        cfg = qgemv_mma._LaunchConfig.from_address(cfg_addr)
        n = len(expected[-1])
        slots = (ctypes.c_void_p * n).from_address(params_addr)
        values = [ctypes.c_uint64.from_address(slots[i]).value for i in range(n)]
        attr = cfg.attrs.contents
        seen.append(dict(grid=(cfg.grid_x, cfg.grid_y, cfg.grid_z), block=(cfg.block_x, cfg.block_y, cfg.block_z),
                         shared=cfg.shared, stream=cfg.stream, func=func, values=values, extra=extra,
                         num_attrs=cfg.num_attrs, attr_id=attr.id, attr_on=int.from_bytes(attr.value[:4], "little")))
        return 0

    stream = {"id": 1234}
    monkeypatch.setattr(qgemv_mma, "_launch_kernel_ex", lambda: fake_launch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=stream["id"]))
    kernel = types.SimpleNamespace(func=777)
    a, b = torch.zeros(4), torch.ones(8)
    expected = []
    for args, grid, block, sid in [([a, b, 5, 7, -1], (3, 2, 1), (128, 1, 1), 1234),
                                   ([b, a, 9, 2 ** 31 + 5, 0], (1, 1, 1), (256, 1, 1), 99),  # the same count again
                                   ([a, 3], (6, 1, 1), (32, 1, 1), 0)]:
        stream["id"] = sid
        expected.append([x.data_ptr() if isinstance(x, torch.Tensor) else x & 0xFFFFFFFF for x in args])
        qgemv_mma._launch_pdl(kernel, grid, block, args)
        got = seen[-1]
        assert got["values"] == expected[-1]
        assert got["grid"] == grid and got["block"] == block and got["shared"] == 0 and got["func"] == 777
        assert (got["stream"] or 0) == sid and got["extra"] is None
        assert got["num_attrs"] == 1 and got["attr_id"] == qgemv_mma._PROGRAMMATIC_STREAM_SERIALIZATION
        assert got["attr_on"] == 1
    assert len(seen) == 3
