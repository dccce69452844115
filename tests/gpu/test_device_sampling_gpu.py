"""The one-kernel device sampler (kernels/sampling.py) on the GPU: large draws against the sort-based reference,
a Qwen-sized vocabulary, and the Sampler's CUDA path against its general path (the same cases run in Triton's
interpreter with small draws: tests/unit/test_device_sampling.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (installed with CUDA torch)")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))
from device_sampling_cases import (DISTRIBUTION_CASES, check_distribution, check_greedy_rows,  # noqa: E402
                                   check_masked_and_seeded, check_non_finite_rows, draw, llm_row, reference_probs)

from pagedllm.layers import sampler as sampler_mod  # noqa: E402
from pagedllm.layers.sampler import Sampler, SamplingMetadata  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402


@pytest.mark.parametrize("case", DISTRIBUTION_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_distribution_matches_reference(case):
    check_distribution(llm_row(64), 200_000, "cuda", **case)


def test_greedy_rows():
    check_greedy_rows("cuda")


def test_non_finite_rows():
    check_non_finite_rows("cuda")


def test_masked_and_seeded():
    check_masked_and_seeded("cuda", vocab=151_936)


@pytest.mark.parametrize("case", [dict(temperature=0.6), dict(temperature=0.6, top_p=0.9),
                                  dict(temperature=0.6, top_k=20, top_p=0.95, k_as_cutoff=True),
                                  dict(temperature=1.0, min_p=0.05, top_p=0.9), dict(temperature=1.0, top_k=5000)])
def test_qwen_sized_vocabulary_stays_in_the_kept_set(case):
    """151,936 logits per row, 512 rows: every token inside the reference's kept set, the top token's frequency
    within 5 sigma of its probability."""
    vocab, n = 151_936, 512
    row = llm_row(vocab, seed=1) * 2.0
    probs = reference_probs(row, case["temperature"], case.get("top_k", 0), case.get("top_p", 1.0),
                            case.get("min_p", 0.0))
    tokens = draw(row, n, "cuda", **case).cpu()
    assert (probs[tokens] > 0).all()
    top = int(probs.argmax())
    p = probs[top].item()
    freq = (tokens == top).double().mean().item()
    assert abs(freq - p) <= 5 * (p * (1 - p) / n) ** 0.5 + 1 / n, (freq, p)


def test_sampler_cuda_path_against_general_path():
    """Sampler() on a mixed CUDA batch (greedy, Qwen-style, top-p alone, min_p, a large top-k, a seed) with the
    device kernel and with the general path: greedy rows equal, every token in its row's kept set, the kernel's
    seeded row independent of the batch."""
    vocab = 32_000
    rows = torch.stack([llm_row(vocab, seed=s) * 2.0 for s in range(6)])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3), SamplingParams(temperature=1.0, min_p=0.05),
              SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(temperature=1.0, top_k=3000)]

    def run(idx, device_sampling=True):
        ps = [params[i] for i in idx]
        meta = SamplingMetadata.build(ps, [[]] * len(ps), [[5]] * len(ps), [None] * len(ps), vocab, "cuda")
        sampler_mod.DEVICE_SAMPLING = device_sampling
        try:
            return Sampler()(rows[idx].cuda(), meta).sampled_token_ids.cpu()
        finally:
            sampler_mod.DEVICE_SAMPLING = True

    fused, general = run(list(range(6))), run(list(range(6)), device_sampling=False)
    for i, p in enumerate(params):
        if p.temperature == 0:
            assert fused[i] == general[i] == rows[i].argmax()
        else:
            ref = reference_probs(rows[i], p.temperature, p.top_k, p.top_p, p.min_p)
            assert ref[fused[i]] > 0 and ref[general[i]] > 0, (i, fused[i], general[i])
    assert run([2])[0] == fused[2] == run([4, 2, 0, 1])[1]


def test_large_top_k_with_top_p():
    """A top-k above DEVICE_TOPK_CUTOFF_MAX in a batch with top-p still takes the kernel (its cutoff from torch.topk,
    so top-p's mass is taken within the top-k set): every token in the reference's set, and a seeded row's token
    the same as in a batch without such a row."""
    vocab = 8000
    k = sampler_mod.DEVICE_TOPK_CUTOFF_MAX + 1
    rows = (llm_row(vocab, seed=2) * 0.5).cuda().repeat(64, 1)
    ps = [SamplingParams(temperature=1.0, top_k=k, top_p=0.7)] * 63 + [SamplingParams(temperature=1.0, top_p=0.7,
                                                                                      seed=9)]
    meta = SamplingMetadata.build(ps, [[]] * 64, [[]] * 64, [None] * 64, vocab, "cuda")
    tokens = sampler_mod.sample_on_device(rows, meta).cpu()
    ref = reference_probs(rows[0].cpu(), 1.0, k, 0.7)
    assert (ref[tokens[:63]] > 0).all()
    alone = SamplingMetadata.build(ps[63:], [[]], [[]], [None], vocab, "cuda")
    assert sampler_mod.sample_on_device(rows[:1], alone)[0].item() == tokens[63].item()


def test_step_seed_keys_unseeded_rows():
    """Unseeded rows follow torch's generator: the same torch.manual_seed, the same tokens."""
    vocab = 4096
    ps = [SamplingParams(temperature=1.0)] * 16
    logits = (llm_row(vocab) * 0.3).cuda().repeat(16, 1)

    def run():
        meta = SamplingMetadata.build(ps, [[]] * 16, [[]] * 16, [None] * 16, vocab, "cuda")
        return Sampler()(logits.clone(), meta).sampled_token_ids.cpu()

    torch.manual_seed(5)
    a = run()
    torch.manual_seed(5)
    b = run()
    c = run()
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("vocab", [5000, 151936])
def test_split_rows_match_one_program(vocab):
    from device_sampling_cases import check_split_rows_match_one_program

    check_split_rows_match_one_program("cuda", vocab)
