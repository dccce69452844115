"""The Triton top-k / top-p cutoff kernel (kernels/top_k_top_p.py) against the torch search and the exact float64
cutoff (GPU; the `small` cases also in Triton's interpreter: PAGEDLLM_TEST_DEVICE=cpu TRITON_INTERPRET=1, which
tests/unit/test_top_k_top_p.py runs)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (installed with CUDA torch)")

from attention_cases import kernel_test_device

DEVICE = kernel_test_device()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from pagedllm.kernels.top_k_top_p import _MAX_PASSES, top_k_top_p_cutoff  # noqa: E402
from pagedllm.layers.top_k_top_p import top_k_top_p_cutoff_torch  # noqa: E402
from tests.unit.top_k_top_p_cases import check_cutoffs, make_logits, row_params  # noqa: E402

KINDS = ["normal", "ties", "peaked", "cold", "hot", "masked"]


def _run(logits, k, p, use_k=True, use_p=True):
    cutoff, passes, converged = top_k_top_p_cutoff(logits.to(DEVICE), k.to(DEVICE) if use_k else None,
                                                   p.to(DEVICE) if use_p else None, with_stats=True)
    converged, passes = converged.cpu(), passes.cpu()
    assert bool((converged == 1).all()), converged
    assert int(passes.max()) <= 2 * _MAX_PASSES
    return cutoff.cpu()


@pytest.mark.parametrize("kind", KINDS)
def test_small(kind):
    gen = torch.Generator().manual_seed(100 + KINDS.index(kind))
    n, vocab = 6, 700
    logits = make_logits(n, vocab, kind, gen)
    k, p = row_params(n, vocab, gen)
    got = _run(logits, k, p)
    check_cutoffs(logits, k, p, got)
    # Top-k alone is a count: exactly the torch search's k-th value.
    got_k = _run(logits, k, p, use_p=False)
    assert torch.equal(got_k, top_k_top_p_cutoff_torch(logits, k, None))


def test_small_top_p_only_and_edge_rows():
    n, vocab = 5, 300
    logits = torch.zeros(n, vocab)
    logits[1, 7] = 3.0  # one large logit
    logits[2] = -0.0  # negative zeros tie with the zero cutoff
    logits[2, :5] = 0.0
    logits[3, ::2] = float("-inf")
    logits[4] = torch.linspace(-5, 5, vocab)
    p = torch.tensor([0.5, 0.9, 0.3, 0.999, 1e-7])
    k = torch.full((n,), vocab)
    got = _run(logits, k, p, use_k=False)
    check_cutoffs(logits, k, p, got)


@pytest.mark.parametrize("kind", ["normal", "peaked", "ties"])
def test_vocab_152k_256_rows(kind):
    if DEVICE != "cuda":
        pytest.skip("too large for the interpreter")
    gen = torch.Generator().manual_seed(7)
    n, vocab = 256, 151936
    logits = make_logits(n, vocab, kind, gen)
    k, p = row_params(n, vocab, gen)
    got = _run(logits, k, p)
    ref = top_k_top_p_cutoff_torch(logits.to(DEVICE), k.to(DEVICE), p.to(DEVICE)).cpu()
    rows = torch.arange(0, n, 16)  # the float64 check row by row is slow: every 16th row
    check_cutoffs(logits[rows], k[rows], p[rows], got[rows])
    # Top-k rows (exact counts) agree with the torch search everywhere, top-p rows but for rounding-close ones.
    only_k = p >= 1.0
    assert torch.equal(got[only_k], ref[only_k])
    assert (got != ref).float().mean() < 0.1
