"""Top-k / top-p without a full sort (layers/top_k_top_p.py) against the sort-based reference and an exact float64
cutoff; the sampler's distribution on a tiny vocabulary; seeded rows whatever the batch (on CUDA too, where the
sampler takes the sort)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers import sampler as sampler_mod
from pagedllm.layers import top_k_top_p as tkp
from pagedllm.layers.sampler import Sampler, SamplingMetadata, apply_top_k_top_p_sort
from pagedllm.layers.top_k_top_p import (apply_top_k_top_p_prefix, top_k_top_p_cutoff_prefix,
                                           top_k_top_p_cutoff_torch)
from pagedllm.sampling_params import SamplingParams
from tests.unit.top_k_top_p_cases import check_cutoffs, make_logits, row_params, support

KINDS = ["normal", "ties", "peaked", "cold", "hot", "masked"]
# The sampler-level tests also run on CUDA (its default: the sort and the exponential race) on the GPU machine.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _skip_without(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.mark.parametrize("kind", KINDS)
def test_cutoff_keeps_the_sort_reference_set(kind):
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    n, vocab = 48, 1000
    logits = make_logits(n, vocab, kind, gen)
    k, p = row_params(n, vocab, gen)
    got = top_k_top_p_cutoff_torch(logits, k, p)
    ref = apply_top_k_top_p_sort(logits.clone(), k, p)
    ambiguous = check_cutoffs(logits, k, p, got, reference_support=ref.softmax(-1) > 0)
    assert ambiguous <= n // 8, ambiguous


@pytest.mark.parametrize("width", [1000, 64, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cutoff_exact_rows_and_the_sorted_rest(kind, width):
    """The prefix path: a row it calls exact keeps the exact set from its `width` largest logits alone; the rows it
    cannot settle (a top-k past the prefix, a top-p crossing or a tie group past it) go to the sort, and every row
    ends with the exact set. Narrow prefixes force both kinds of row."""
    gen = torch.Generator().manual_seed(30 + KINDS.index(kind))
    n, vocab = 48, 1000
    logits = make_logits(n, vocab, kind, gen)
    k, p = row_params(n, vocab, gen)
    cutoff, exact = top_k_top_p_cutoff_prefix(logits, k, p, width=width)
    if width >= vocab:
        assert exact.all()
    elif width == 8:  # rows with top_k 334 and rows of a broad top-p cannot be settled by 8 values
        assert not exact.all() and exact.any()
    assert bool((~exact[(k > width) & (k < vocab)]).all())
    rows = exact.nonzero().squeeze(1)
    check_cutoffs(logits[rows], k[rows], p[rows], cutoff[rows])
    masked = apply_top_k_top_p_prefix(logits.clone(), k, p)
    ref = apply_top_k_top_p_sort(logits.clone(), k, p)
    assert torch.isfinite(masked.max(dim=1).values).all()  # the top token always stays
    check_cutoffs(logits, k, p, torch.where(torch.isfinite(masked), logits, float("inf")).min(dim=1).values,
                  reference_support=ref.softmax(-1) > 0)


@pytest.mark.parametrize("only", ["top_k", "top_p"])
def test_prefix_cutoff_with_one_filter(only):
    gen = torch.Generator().manual_seed(41)
    n, vocab = 32, 3000
    logits = make_logits(n, vocab, "ties", gen)
    k = torch.tensor([1, 5, 17, vocab] * (n // 4)) if only == "top_k" else torch.full((n,), vocab)
    p = torch.tensor([1e-7, 0.9, 0.99, 1.0] * (n // 4)) if only == "top_p" else torch.ones(n)
    cutoff, exact = top_k_top_p_cutoff_prefix(logits, k if only == "top_k" else None, p if only == "top_p" else None,
                                              width=256)
    rows = exact.nonzero().squeeze(1)
    check_cutoffs(logits[rows], k[rows], p[rows], cutoff[rows])
    if only == "top_p":  # a crossing at the first token is found in the prefix; top_p 1 needs no search
        assert exact[(p < 1e-6) | (p == 1.0)].all()
    if only == "top_k":  # counts are exact: torch.topk's k-th value on every row
        assert exact.all()
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k.clamp(max=vocab) - 1).unsqueeze(1)).squeeze(1)
        assert torch.equal(torch.where(k < vocab, kth, float("-inf")), cutoff)
    masked = apply_top_k_top_p_prefix(logits.clone(), k if only == "top_k" else None, p if only == "top_p" else None)
    check_cutoffs(logits, k, p, torch.where(torch.isfinite(masked), logits, float("inf")).min(dim=1).values)


def test_prefix_widens_to_the_batchs_largest_top_k(monkeypatch):
    """With the batch's largest top-k given, top-k rows past the default prefix are settled without the sort."""
    monkeypatch.setattr(tkp, "_PREFIX", 8)
    sorted_rows = []
    monkeypatch.setattr(tkp, "top_k_top_p_cutoff_sort", lambda x, k, p: sorted_rows.append(x.shape[0]) or
                        torch.full((x.shape[0],), float("-inf")))
    gen = torch.Generator().manual_seed(43)
    logits = make_logits(16, 2000, "normal", gen)
    k = torch.tensor([300, 5, 2000, 40] * 4)
    masked = tkp.apply_top_k_top_p_prefix(logits.clone(), k, None, max_top_k=300)
    assert sorted_rows == []
    check_cutoffs(logits, k, torch.ones(16), torch.where(torch.isfinite(masked), logits, float("inf")).min(1).values)
    tkp.apply_top_k_top_p_prefix(logits.clone(), k, None)  # without it: the rows of top-k 300 and 40 are sorted
    assert sorted_rows == [8]
    # Qwen3's top-k 20 / top-p 0.95 never needs the sort.
    sorted_rows.clear()
    monkeypatch.setattr(tkp, "_PREFIX", 64)
    logits = make_logits(16, 2000, "peaked", gen)
    k = torch.full((16,), 20)
    p = torch.full((16,), 0.95)
    masked = tkp.apply_top_k_top_p_prefix(logits.clone(), k, p, max_top_k=20)
    assert sorted_rows == []
    check_cutoffs(logits, k, p, torch.where(torch.isfinite(masked), logits, float("inf")).min(1).values)
    masked = tkp.apply_top_k_top_p_prefix(logits.clone(), k, p, max_top_k=20, top_p_within_top_k=True)
    assert sorted_rows == []
    check_cutoffs(logits, k, p, torch.where(torch.isfinite(masked), logits, float("inf")).min(1).values)


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_top_p_within_top_k_needs_no_sort(kind, monkeypatch):
    """Every top-p row with a top-k: a prefix of the batch's largest top-k settles every row, also when the k-th
    value's ties run far past k (their mass counted over the row), without the sort or a host sync."""
    monkeypatch.setattr(tkp, "top_k_top_p_cutoff_sort", lambda *a: pytest.fail("sorted"))
    gen = torch.Generator().manual_seed(50 + KINDS.index(kind))
    n, vocab = 48, 1000
    logits = make_logits(n, vocab, kind, gen)
    k = torch.randint(1, 60, (n,), generator=gen)
    k[::3] = 12
    for r in range(0, n, 3):  # a tie group of 390 at the 12th value: 378 of them past k
        order = logits[r].argsort(descending=True)
        logits[r, order[11:401]] = float(logits[r, order[11]])
    p = torch.where(torch.rand(n, generator=gen) < 0.2, 1.0, torch.rand(n, generator=gen)).to(torch.float32)
    masked = tkp.apply_top_k_top_p_prefix(logits.clone(), k, p, max_top_k=int(k.max()), top_p_within_top_k=True)
    got = torch.where(torch.isfinite(masked), logits, float("inf")).min(1).values
    ref = apply_top_k_top_p_sort(logits.clone(), k, p)
    ambiguous = check_cutoffs(logits, k, p, got, reference_support=ref.softmax(-1) > 0)
    assert ambiguous <= n // 8, ambiguous


@pytest.mark.parametrize("case", ["top_k_only", "top_p_only", "large_k"])
def test_cutoff_single_filter(case, monkeypatch):
    gen = torch.Generator().manual_seed(11)
    n, vocab = 32, 3000
    logits = make_logits(n, vocab, "ties", gen)
    k = torch.full((n,), vocab)
    p = torch.ones(n)
    if case == "top_k_only":
        k = torch.tensor([1, 5, 17, vocab] * (n // 4))
    elif case == "top_p_only":
        p = torch.tensor([1e-7, 0.9, 0.99, 1.0] * (n // 4))
    else:  # top-k past the direct torch.topk size: the counting search
        monkeypatch.setattr(tkp, "_TOPK_DIRECT", 64)
        k = torch.randint(65, vocab, (n,), generator=gen)
    got = top_k_top_p_cutoff_torch(logits, None if case == "top_p_only" else k,
                                   None if case != "top_p_only" else p)
    check_cutoffs(logits, k, p, got)
    if case != "top_p_only":  # counts are exact: identical to torch.topk's k-th value
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k.clamp(max=vocab) - 1).unsqueeze(1)).squeeze(1)
        assert torch.equal(torch.where(k < vocab, kth, float("-inf")), got)


def test_cutoff_narrows_in_several_passes(monkeypatch):
    """A crossing bucket too large to rank directly is split again (and a row of ties stops the splitting)."""
    monkeypatch.setattr(tkp, "_BUCKETS", 16)
    monkeypatch.setattr(tkp, "_CANDIDATES", 8)
    gen = torch.Generator().manual_seed(12)
    n, vocab = 16, 4000
    logits = make_logits(n, vocab, "hot", gen)
    logits[3] = 0.25  # one value: ties only
    k = torch.full((n,), vocab)
    k[::2] = torch.randint(1, vocab, (n // 2,), generator=gen)
    p = torch.rand(n, generator=gen)
    monkeypatch.setattr(tkp, "_TOPK_DIRECT", 0)
    got = top_k_top_p_cutoff_torch(logits, k, p)
    check_cutoffs(logits, k, p, got)


def _params_mix():
    return [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=1e-3, top_p=0.95),
        SamplingParams(temperature=50.0, top_k=1),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.9, top_p=1e-6),
        SamplingParams(temperature=2.0, top_k=300, top_p=0.5, min_p=0.01),
        SamplingParams(temperature=1.0),
    ]


def _probs(logits, params, impl, monkeypatch):
    monkeypatch.setattr(sampler_mod, "TOP_K_TOP_P_IMPL", impl)
    n, vocab = logits.shape
    meta = SamplingMetadata.build(params, [[]] * n, [[]] * n, [None] * n, vocab, "cpu")
    return Sampler.probs(logits.clone(), meta)


@pytest.mark.parametrize("kind", ["normal", "ties", "peaked"])
def test_sampler_probs_match_the_sort_path(kind, monkeypatch):
    """The whole processing (temperature, min_p, top-k, top-p) with mixed per-row parameters: the same
    distribution, support for support, as the sort path."""
    gen = torch.Generator().manual_seed(20 + KINDS.index(kind))
    params = _params_mix() * 3
    logits = make_logits(len(params), 512, kind, gen)
    ref = _probs(logits, params, "sort", monkeypatch)
    for impl in ("cutoff", "prefix"):
        new = _probs(logits, params, impl, monkeypatch)
        assert torch.equal(new > 0, ref > 0), impl
        torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-7)


def _expected(row, temperature, top_k, top_p, min_p):
    """The filtered distribution in float64, straight from the definitions."""
    x = row.double() / temperature
    probs = x.softmax(-1)
    keep = probs >= probs.max() * min_p
    order = torch.argsort(x, descending=True, stable=True).tolist()
    top = set(order[:top_k])
    keep &= torch.tensor([i in top for i in range(len(row))])
    q = torch.where(keep, probs, 0.0)
    q = q / q.sum()
    mass, chosen = 0.0, set()
    for i in torch.argsort(q, descending=True, stable=True).tolist():
        if mass >= top_p:
            break
        chosen.add(i)
        mass += float(q[i])
    q = torch.where(torch.tensor([i in chosen for i in range(len(row))]), q, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("impl", ["auto", "prefix"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (0.7, 6, 0.85, 0.0), (1.0, 8, 1.0, 0.05), (1.5, 3, 0.9, 0.0), (1.0, 8, 0.6, 0.1)])
def test_sampled_distribution_on_a_tiny_vocabulary(temperature, top_k, top_p, min_p, device, impl, monkeypatch):
    """Chi-square of 30k draws against the exact filtered distribution (well-separated logits, so no cutoff is
    near a rounding; fixed seeds, and a critical value far in the tail: 1e-6 at these degrees of freedom)."""
    _skip_without(device)
    monkeypatch.setattr(sampler_mod, "TOP_K_TOP_P_IMPL", impl)
    torch.manual_seed(1234)
    row = torch.tensor([2.1, 1.7, 1.2, 0.9, 0.3, -0.4, -1.1, -2.0])
    expected = _expected(row, temperature, top_k, top_p, min_p)
    n = 30000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * n
    meta = SamplingMetadata.build(params, [[]] * n, [[]] * n, [None] * n, row.numel(), device)
    out = Sampler()(row.expand(n, -1).contiguous().to(device), meta).sampled_token_ids.cpu()
    counts = torch.bincount(out, minlength=row.numel()).double()
    support_ = expected > 0
    assert counts[~support_].sum() == 0, counts
    e = expected[support_] * n
    chi2 = float(((counts[support_] - e) ** 2 / e).sum())
    dof = int(support_.sum()) - 1
    critical = {1: 23.9, 2: 27.6, 3: 30.7, 4: 33.4, 5: 35.9, 6: 38.3, 7: 40.5}[dof]
    assert chi2 < critical, (chi2, dof, counts / n, expected)


@pytest.mark.parametrize("impl", ["auto", "prefix"])
@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_independent_of_the_batch(monkeypatch, device, impl):
    """A seeded row draws the same token alone and among rows whose filters take other paths of the search
    (small and large top-k, top-p, greedy), and when the global RNG moved. The prefix path: a top-k of 2000 in the
    batch widens the prefix past its default."""
    _skip_without(device)
    monkeypatch.setattr(sampler_mod, "TOP_K_TOP_P_IMPL", impl)
    monkeypatch.setattr(tkp, "_PREFIX", 256)  # the seeded row's top-p is settled in 256 values or sorted
    gen = torch.Generator().manual_seed(5)
    vocab = 3000
    row = make_logits(1, vocab, "normal", gen)[0]
    history = [[7, 8, 9]]
    seeded = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=77)
    others = [SamplingParams(temperature=1.0, top_k=2000), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_p=0.3), SamplingParams(temperature=0.5, min_p=0.1)]

    def draw(batch, at, torch_seed):
        torch.manual_seed(torch_seed)
        n = len(batch)
        logits = make_logits(n, vocab, "normal", torch.Generator().manual_seed(torch_seed))
        logits[at] = row
        outputs = [[1]] * n
        outputs[at] = history[0]
        meta = SamplingMetadata.build(batch, [[]] * n, outputs, [None] * n, vocab, device)
        return int(Sampler()(logits.to(device), meta).sampled_token_ids[at])

    alone = draw([seeded], 0, 1)
    assert draw(others[:2] + [seeded] + others[2:], 2, 2) == alone
    assert draw([seeded] + others, 0, 3) == alone
    assert draw(others[::-1] + [seeded], 4, 4) == alone
    monkeypatch.setattr(tkp, "_TOPK_DIRECT", 100)  # the top-k 2000 row moves the batch to the counting search
    assert draw(others + [seeded], 4, 5) == alone
    monkeypatch.setattr(tkp, "_CANDIDATES", 4)  # and rows split again (the seeded row's own count decides)
    assert draw([seeded] + others, 0, 6) == alone
    draws = {draw([SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=s)], 0, 1) for s in range(30)}
    assert len(draws) > 2  # the seed matters


def test_the_choice_per_device_and_batch():
    """CPU: the bucket search. CUDA: the prefix path where every top-p row has a top-k and the batch is large
    enough for torch.topk to beat the sort; the sort otherwise (top-p alone would need a host sync)."""
    def choice(params, rows, cuda):
        meta = SamplingMetadata.build(params * rows, [[]] * rows, [[]] * rows, [None] * rows, 1000, "cpu")
        return sampler_mod.top_k_top_p_impl(meta, rows, cuda)

    qwen = [SamplingParams(temperature=0.6, top_k=20, top_p=0.95)]
    many = sampler_mod.PREFIX_MIN_ROWS
    assert choice(qwen, many, cuda=False) == "cutoff"
    assert choice(qwen, many, cuda=True) == "prefix"
    assert choice(qwen, many - 1, cuda=True) == "sort"
    assert choice([SamplingParams(temperature=0.6, top_p=0.9)], many, cuda=True) == "sort"
    assert choice(qwen + [SamplingParams(temperature=0.6, top_p=0.9)], many, cuda=True) == "sort"
    # a greedy row's top-p is never applied to its token: it does not send the batch to the sort
    assert choice(qwen + [SamplingParams(temperature=0.0, top_p=0.9)], many, cuda=True) == "prefix"
    assert choice([SamplingParams(temperature=0.6, top_k=20)], many, cuda=True) == "sort"  # top-k alone: topk


def test_support_helper_drops_zero_probabilities():
    logits = torch.tensor([[0.0, -200.0, 1.0]])
    assert support(logits, torch.tensor([float("-inf")])).tolist() == [[True, False, True]]
