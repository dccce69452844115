"""Direct launches of the compiled Triton kernels (kernels/triton_launch.py) on the GPU: the kernels a step runs
eagerly (argmax, the one-row GEMV, the sampler, the speculation kernels) give the same results launched directly as
through Triton's own launch, across the specializations a run meets (row counts, alignments, options), and the
direct path is the one taken once a specialization was seen. tests/unit/test_triton_launch.py has the CPU side."""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from pagedllm.kernels import triton_launch  # noqa: E402


@pytest.fixture
def direct_on():
    triton_launch.set_enabled(True)
    yield
    triton_launch.set_enabled(None)


def _went_direct(kernel) -> None:
    """This Triton's compiled launcher took the arguments (not turned off by a refusal) and a kernel was kept."""
    assert kernel.usable and kernel.verified and kernel.compiled


def _both(fn):
    """fn() through Triton's launch, then twice directly (the first of those may still compile or fill the cache)."""
    triton_launch.set_enabled(False)
    want = fn()
    triton_launch.set_enabled(True)
    fn()
    return want, fn()


@pytest.mark.parametrize("rows,vocab,offset", [(1, 49152, 0), (1, 151936, 3), (5, 32000, 0), (17, 1000, 1)])
def test_argmax_direct_equals_triton(direct_on, rows, vocab, offset):
    from pagedllm.kernels.argmax import _argmax_partial, argmax_rows

    torch.manual_seed(rows)
    base = torch.randn(rows, vocab + offset, device="cuda", dtype=torch.bfloat16)
    x = base[:, offset:]  # rows not 16-byte aligned when offset is odd
    want, got = _both(lambda: argmax_rows(x))
    assert torch.equal(want, got) and torch.equal(got, x.float().argmax(-1))
    _went_direct(_argmax_partial)


@pytest.mark.parametrize("n,k", [(49152, 576), (4096, 4096), (1536, 576)])
def test_gemv_direct_equals_triton(direct_on, n, k):
    from pagedllm.kernels.gemv import _gemv, gemv

    torch.manual_seed(n)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    want, got = _both(lambda: gemv(x, w))
    assert torch.equal(want, got)
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, atol=2e-2, rtol=2e-2)
    _went_direct(_gemv)


def test_sampler_direct_equals_triton(direct_on):
    from pagedllm.kernels.sampling import sample_rows

    torch.manual_seed(0)
    logits = torch.randn(8, 32000, device="cuda", dtype=torch.float32)
    temperature = torch.tensor([0.0, 0.6, 1.0, 0.6, 0.0, 1.2, 0.6, 0.8], device="cuda")
    seed = (1 << 40) + 12345
    want, got = _both(lambda: sample_rows(logits, temperature, seed))
    assert torch.equal(want, got)  # the same keys draw the same tokens
    from pagedllm.kernels.sampling import _sample_launch, _sample_split_launch

    assert _sample_launch.verified or _sample_split_launch.verified
    assert torch.equal(got[0], logits[0].argmax()) and torch.equal(got[4], logits[4].argmax())


def test_spec_kernels_direct_equal_triton(direct_on):
    from pagedllm.kernels.spec_decode import _spec_outputs, spec_step_outputs

    torch.manual_seed(0)
    k, width = 4, 64

    def run():
        hist = torch.randint(0, 3, (4, width), device="cuda", dtype=torch.int32)
        lens = torch.tensor([20, 30, 9, 40], device="cuda")
        drafts = torch.zeros(4, k, dtype=torch.int64, device="cuda")
        num_drafts = torch.zeros(4, dtype=torch.int64, device="cuda")
        rows = torch.tensor([0, 1, 3], device="cuda")
        counts = torch.tensor([1, 1, 1], device="cuda")
        starts = torch.arange(3, device="cuda")
        final = torch.tensor([1, 2, 0], device="cuda")
        stats = spec_step_outputs(rows, starts, counts, final, hist, lens, drafts, num_drafts, 2, 4, True)
        return torch.cat([stats.flatten(), hist.flatten().long(), lens, drafts.flatten(), num_drafts])

    torch.manual_seed(0)
    triton_launch.set_enabled(False)
    want = run()
    triton_launch.set_enabled(True)
    for _ in range(2):
        torch.manual_seed(0)
        got = run()
        assert torch.equal(want, got)
    _went_direct(_spec_outputs)


def test_kept_kernels_have_the_fast_runner_on_this_triton(direct_on):
    """This Triton's compiled-kernel runner has the shape kernels/triton_launch.fast_runner knows, so every kept
    kernel launches through `run` directly (no launch hook is set in the tests)."""
    from pagedllm.kernels.argmax import _argmax_partial, argmax_rows

    x = torch.randn(1, 4096, device="cuda")
    argmax_rows(x)
    argmax_rows(x)
    assert triton_launch._runner_shape_known(), "this Triton's CompiledKernel runner calls `run` otherwise"
    assert all(fast is not None for _, fast in _argmax_partial.compiled.values())
