"""GPU tests run on a CUDA machine (`make test-gpu`: tests/gpu/run_shards.sh, shard by shard). Without Triton (CI,
CPU-only installs) the kernel test modules skip at import with that reason (`pytest.importorskip`), so they show in
the summary as skipped instead of vanishing; the rest skip without CUDA. Every gpu-marked test gets the isolation of
tests/conftest.py (`_gpu_test_isolation`).

With TRITON_INTERPRET=1 (PAGEDLLM_TEST_DEVICE=cpu: the kernels in Triton's interpreter on a CPU), comparisons are
tagged as int1 here: Triton 3.9's interpreter tags `a < b` with the operands' dtype (int32), so a scalar comparison
broadcast against a block mask (`n_ok & (first < NUM_CHUNKS)`) is splat as int32 and every load under that mask
fails with "mask has unsupported dtype". Compiled kernels are unaffected (comparisons are i1 in the IR)."""
from __future__ import annotations

import os

import pytest

# int32 0x7FC07FC0 reads as NaN in float32, and in both halves as bfloat16 or float16.
_NAN_WORD = 0x7FC07FC0


@pytest.fixture
def stale_cuda_memory():
    """Before the test, fill the CUDA caching allocator's free memory with NaN, so an output element a kernel
    leaves unwritten (in `torch.empty` memory) reads as NaN and fails the comparison, alone or after other tests:
    alone, a fresh process's memory is often zeros, which hides such a bug; in a long run it holds whatever the
    previous tests left (an order-dependent failure). Blocks of 1 MiB fill the allocator's small pool, one large
    block the large pool; freed, both stay cached for the test's allocations."""
    import torch

    if torch.cuda.is_available():
        small = [torch.full((1 << 18,), _NAN_WORD, dtype=torch.int32, device="cuda") for _ in range(64)]
        large = torch.full((1 << 28,), _NAN_WORD, dtype=torch.int32, device="cuda")  # 1 GiB
        torch.cuda.synchronize()
        del small, large
    yield


def _tag_comparisons_as_int1() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_pagedllm_int1_comparisons", False):
        return

    def as_int1(compare):
        def wrapped(self, lhs, rhs):
            return interpreter.TensorHandle(compare(self, lhs, rhs).data, tl.int1)
        return wrapped

    for name in dir(builder):
        if name.startswith(("create_icmp", "create_fcmp")):
            setattr(builder, name, as_int1(getattr(builder, name)))
    builder._pagedllm_int1_comparisons = True


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        _tag_comparisons_as_int1()
