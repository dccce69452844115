"""For tests/unit/test_top_k_top_p.py: logits with the hard cases
(ties at the cutoff, extreme temperatures, -inf tokens), per-row top-k / top-p, and the exact float64 cutoff with
its ambiguity (a row whose top-p cutoff mass lies within float32 rounding of p, where float32 sums in different
orders may rightly disagree by a token). Not a test module."""
from __future__ import annotations

import torch

# Relative mass within which a float32 sum (the sort reference's cumulative sum over V terms, or the search's
# bucket sums) may land on either side of p * mass: a few V x 2^-24 with room to spare.
AMBIGUOUS = 1e-5


def make_logits(n: int, vocab: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, vocab, generator=gen)
    if kind == "normal":
        return x * 2.0
    if kind == "ties":  # a few dozen distinct values: every cutoff falls in a run of ties
        return (x * 2.0).round() / 2.0
    if kind == "peaked":  # an LLM-like row: a few large logits over a long flat tail
        x = x * 1.5
        top = torch.randint(0, vocab, (n, 8), generator=gen)
        return x.scatter_add_(1, top, torch.rand(n, 8, generator=gen) * 12.0)
    if kind == "cold":  # temperature 1e-3: logits spread over thousands of nats, most probabilities underflow
        return x * 2.0 / 1e-3
    if kind == "hot":  # temperature 1e3: nearly flat
        return x * 2.0 / 1e3
    if kind == "masked":  # min_p / bad words: many -inf
        x = x * 2.0
        return x.masked_fill_(torch.rand(n, vocab, generator=gen) < 0.6, float("-inf"))
    raise ValueError(kind)


def row_params(n: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixed per-row top_k in {1, 5, random, V (none)} and top_p in {tiny, 0.9, random, 1.0 (none)}."""
    ks = torch.tensor([1, 5, vocab, vocab // 3 + 1])
    ps = torch.tensor([1e-7, 0.9, 1.0, 0.5])
    k = ks[torch.randint(0, 4, (n,), generator=gen)]
    p = ps[torch.randint(0, 4, (n,), generator=gen)]
    swap = torch.rand(n, generator=gen) < 0.3
    p = torch.where(swap, torch.rand(n, generator=gen), p)
    return k.to(torch.int64), p.to(torch.float32)


def exact_cutoff(row: torch.Tensor, k: int, p: float) -> tuple[float, bool]:
    """The kept set's smallest logit in float64 (-inf: all kept) and whether the row is ambiguous (AMBIGUOUS)."""
    vocab = row.numel()
    x = row.double()
    desc = x.sort(descending=True).values
    kth = float(desc[k - 1]) if k < vocab else float("-inf")
    if p >= 1.0:
        return kth, False
    in_set = desc >= kth
    vals = desc[in_set]
    w = (vals - vals[0]).exp()
    total = float(w.sum())
    target = p * total
    exclusive = w.cumsum(0) - w
    neg = (-vals).contiguous()
    first_tie = torch.searchsorted(neg, neg)
    strictly_above = exclusive[first_tie]
    kept = strictly_above < target
    cutoff = float(vals[int(kept.sum()) - 1])
    # The top tie group (nothing above it) is kept by every implementation, however small p is.
    ambiguous = bool((((strictly_above - target).abs() <= AMBIGUOUS * total) & (strictly_above > 0)).any())
    return cutoff, ambiguous


def support(logits: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """Tokens with a non-zero probability once the logits below the cutoff are dropped."""
    masked = logits.masked_fill(logits < cutoff.unsqueeze(1), float("-inf"))
    return masked.softmax(dim=-1) > 0


def check_cutoffs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, got: torch.Tensor,
                  reference_support: torch.Tensor | None = None) -> int:
    """Every unambiguous row keeps exactly the exact set (and the reference's, when given); an ambiguous row's
    cutoff is the exact one or a neighbour within rounding. Returns the number of ambiguous rows."""
    n, vocab = logits.shape
    exact = torch.empty(n)
    ambiguous = []
    for i in range(n):
        c, amb = exact_cutoff(logits[i], int(top_k[i]), float(top_p[i]))
        exact[i] = c
        ambiguous.append(amb)
    got_support = support(logits, got)
    exact_support = support(logits, exact.to(logits.dtype))
    for i in range(n):
        if ambiguous[i]:
            # Only tokens whose strict-above mass is within rounding of the target may differ.
            x = logits[i].double()
            kth = float(x.sort(descending=True).values[int(top_k[i]) - 1]) if top_k[i] < vocab else float("-inf")
            in_set = x >= kth
            w = torch.where(in_set, (x - x.max()).exp(), torch.zeros_like(x))
            total, target = float(w.sum()), float(top_p[i]) * float(w.sum())
            differing = x[(got_support[i] ^ exact_support[i]).nonzero().flatten()].unique()  # tie groups
            for value in differing.tolist():
                above = float(w[x > value].sum())
                assert abs(above - target) <= AMBIGUOUS * total, (i, value, above, target)
            continue
        assert torch.equal(got_support[i], exact_support[i]), (i, int(top_k[i]), float(top_p[i]), float(got[i]),
                                                               float(exact[i]))
        if reference_support is not None:
            assert torch.equal(reference_support[i], exact_support[i]), i
    return sum(ambiguous)
