"""Top-k / top-p without a full sort: each row's cutoff logit, found by a bucket search.

A row keeps {logits >= cutoff}: the set the sort-based reference (`sampler.apply_top_k_top_p_sort`) keeps.
  * top-k: the cutoff is the k-th largest logit; every token tied with it stays.
  * top-p: within the top-k set S (every token without top-k), a token stays iff the mass of S strictly above it
    is < p * mass(S): the smallest set of top tokens whose mass reaches p, with every token tied at the cutoff
    kept (the reference keeps every logit >= the one where its ascending cumulative sum passes 1 - p).
Both cutoffs are "the largest value v whose weight (count, or mass) of tokens >= v reaches a target". A pass
splits a bracket of values into buckets, sums the weight per bucket and keeps the bucket where the cumulative
weight from the top crosses the target; the bucket's tokens (few, once the bracket is narrow) are then ranked
exactly. Equal floats always fall in the same bucket, so ties at the cutoff are kept whole, as the reference
keeps them. The sums differ from the reference's float32 cumulative sum in rounding only: the kept sets differ
only for a row whose cutoff mass is within rounding of p (tests/unit/test_top_k_top_p.py checks both).

Top-p's search starts at a lower bound that is always below the cutoff: the tokens under m + log((1 - p) / V)
(m the row's max) weigh less than (1 - p) of the row together, since each weighs less than (1 - p) / V of the
max token's weight, which is part of S. So the first bucket pass spans a few dozen nats however far the tail goes.
A row with both filters and a top-k up to _TOPK_DIRECT skips the buckets: torch.topk gives its k top values,
which it ranks directly (Qwen3's top_k 20 / top_p 0.95 touches the rest of the row twice: topk and one count).

This search is the CPU's path: it reads the number of candidates on the host, which costs nothing there (a
one-program-per-row Triton version lost to the sort on the H200 and was deleted). CUDA takes the prefix path below
(each row's largest logits by torch.topk, no host sync) or the sort, as `sampler.top_k_top_p_impl` chooses
(docs/benchmarks.md, "Sampling").
"""
from __future__ import annotations

from typing import Optional

import torch


_BUCKETS = 2048  # buckets per pass
_CANDIDATES = 512  # a row whose crossing bucket holds more tokens is split again before ranking it (torch.topk)
_PASSES = 3  # bucket passes before ranking the crossing bucket whatever its size (a bucket of ties cannot narrow)
_TOPK_DIRECT = 8192  # top-k up to this size reads the k-th value from torch.topk (a partial selection) instead
_PREFIX = 1024  # the prefix path's width: each row's largest logits it ranks (torch.topk)
_CHUNK_ELEMENTS = 1 << 21  # rows are processed in chunks of about this many logits: small temporaries stay cached


def top_k_top_p_cutoff_torch(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                             top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """logits [N, V] float32; top_k [N] int64 (>= V: none) or None; top_p [N] float32 (1: none) or None
    -> cutoff [N] float32, -inf where the row keeps all. Which way a row goes depends on its own top_k / top_p
    only, so its arithmetic (and a seeded request's token) does not depend on the rest of the batch."""
    n, vocab = logits.shape
    cutoff = logits.new_full((n,), float("-inf"))
    if n == 0:
        return cutoff
    chunk = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, n, chunk):
        rows = slice(start, min(n, start + chunk))
        cutoff[rows] = _chunk_cutoff(logits[rows], None if top_k is None else top_k[rows],
                                     None if top_p is None else top_p[rows])
    return cutoff


def _chunk_cutoff(x: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]) -> torch.Tensor:
    n, vocab = x.shape
    neg_inf = float("-inf")
    cutoff = x.new_full((n,), neg_inf)
    has_k = top_k < vocab if top_k is not None else torch.zeros(n, dtype=torch.bool, device=x.device)
    has_p = top_p < 1.0 if top_p is not None else torch.zeros(n, dtype=torch.bool, device=x.device)
    p_done = torch.zeros(n, dtype=torch.bool, device=x.device)
    small = has_k & (top_k <= _TOPK_DIRECT) if top_k is not None else has_k
    if bool(small.any()):
        # The k-th value from torch.topk; rows that also have top-p rank their top k values exactly.
        rows = small.nonzero().squeeze(1)
        ks = top_k[rows]
        vals = x[rows].topk(int(ks.max()), dim=1).values
        kth = vals.gather(1, (ks - 1).unsqueeze(1)).squeeze(1)
        cutoff[rows] = kth
        both = has_p[rows]
        if bool(both.any()):
            sub = rows[both]
            cutoff[sub] = _top_p_within_top_k(x[sub], vals[both], ks[both], kth[both], top_p[sub])
            p_done[sub] = True
    large = has_k & ~small
    if bool(large.any()):
        rows = large.nonzero().squeeze(1)
        xs = x[rows]
        finite = xs > neg_inf
        low = xs.amin(1)
        if bool((low == neg_inf).any()):
            low = xs.masked_fill(~finite, float("inf")).amin(1)
        kth = _search_rows(xs, None, finite, top_k[rows].to(x.dtype), xs.amax(1), low)
        # Fewer finite logits than k (min_p masked the rest): the k-th largest is -inf, which keeps all.
        cutoff[rows] = torch.where(finite.sum(1) < top_k[rows], neg_inf, kth)
    rest = has_p & ~p_done
    if bool(rest.any()):
        sel = rest.nonzero().squeeze(1)
        xs, p, below = x[sel], top_p[sel], cutoff[sel]
        m = xs.amax(1)
        weight = (xs - m.unsqueeze(1)).exp_()  # the max token weighs exactly 1
        target = p * torch.where(xs >= below.unsqueeze(1), weight, 0.0).sum(1)
        # The lower bound (module docstring), one nat lower for rounding, never below the top-k cutoff, nor below
        # the row's smallest logit (a flat row then spreads over every bucket).
        bound = torch.maximum(below, m + torch.log((1.0 - p) / xs.shape[1]) - 1.0)
        bound = torch.maximum(bound, xs.amin(1))
        member = xs >= bound.unsqueeze(1)
        cutoff[sel] = _search_rows(xs, weight, member, target, m, bound)
    return cutoff


def _top_p_within_top_k(x: torch.Tensor, vals: torch.Tensor, k: torch.Tensor, kth: torch.Tensor,
                        p: torch.Tensor) -> torch.Tensor:
    """Top-p of rows whose top-k values are known (vals [n, >= k] descending): the set's mass is theirs plus the
    tokens tied with the k-th value beyond the first k (counted over the row), so no pass over the row's weights."""
    width = vals.shape[1]
    first_k = torch.arange(width, device=x.device).unsqueeze(0) < k.unsqueeze(1)
    m = vals[:, :1]
    w = (vals - m).exp_().masked_fill_(~first_k, 0.0)
    ties_beyond = (x >= kth.unsqueeze(1)).sum(1) - k  # every token >= the k-th value is in the set
    total = w.sum(1) + ties_beyond.to(x.dtype) * (kth - m.squeeze(1)).exp()
    return _rank_candidates(vals, w, first_k, x.new_zeros(x.shape[0]), p * total)


def _bucket_pass(x: torch.Tensor, weight: Optional[torch.Tensor], member: torch.Tensor, target: torch.Tensor,
                 above: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor):
    """One pass: split [lo, hi] into _BUCKETS buckets, keep the one where the weight from the top (above + the
    buckets over it) reaches target. -> (its members, the weight above it, its token count)."""
    n = x.shape[0]
    r = torch.arange(n, device=x.device)
    width = hi - lo
    scale = torch.where(width > 0, _BUCKETS / width, torch.zeros_like(width))
    # Bucket 0 holds the largest values; the float ops are monotone, so equal values share a bucket.
    pos = (hi.unsqueeze(1) - x).mul_(scale.unsqueeze(1)).clamp_(0, _BUCKETS - 1)
    idx = pos.to(torch.int64).masked_fill_(~member, _BUCKETS)  # non-members: a dump column
    del pos
    counts = x.new_zeros(n, _BUCKETS + 1).scatter_add_(1, idx, x.new_ones(1).expand_as(x))[:, :_BUCKETS]
    sums = counts if weight is None else x.new_zeros(n, _BUCKETS + 1).scatter_add_(1, idx, weight)[:, :_BUCKETS]
    cum = sums.cumsum(1) + above.unsqueeze(1)
    b = (cum < target.unsqueeze(1)).sum(1)
    # Only a non-empty bucket can hold the cutoff; rounding can point next to one.
    nonempty = counts > 0
    first = nonempty.to(torch.int8).argmax(1)
    last = _BUCKETS - 1 - nonempty.flip(1).to(torch.int8).argmax(1)
    b = torch.minimum(torch.maximum(b, first), last)
    return idx == b.unsqueeze(1), cum[r, b] - sums[r, b], counts[r, b].to(torch.int64)


def _search_rows(x: torch.Tensor, weight: Optional[torch.Tensor], member: torch.Tensor, target: torch.Tensor,
                 hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The largest member value v whose weight of member tokens >= v reaches target (weight None: counts).
    hi is each row's max logit (the weights are exp(x - hi)), lo a bound below its member values. A row whose
    members never reach the target (rounding) gets the smallest value of its last bucket: a superset by that
    rounding. A row's arithmetic never depends on the other rows (a seeded request samples the same token
    whatever the batch): a row is split again only for its own count."""
    row_max = hi
    member, above, count = _bucket_pass(x, weight, member, target, x.new_zeros(x.shape[0]), hi, lo)
    for _ in range(_PASSES - 1):
        again = (count > _CANDIDATES).nonzero().squeeze(1)
        if again.numel() == 0:
            break
        m_again = member[again]
        x_again = x[again]
        lo = x_again.masked_fill(~m_again, float("inf")).amin(1)
        hi = x_again.masked_fill(~m_again, float("-inf")).amax(1)
        narrow = hi > lo  # a bucket of ties cannot be split
        again, m_again, x_again, lo, hi = again[narrow], m_again[narrow], x_again[narrow], lo[narrow], hi[narrow]
        if again.numel() == 0:
            break
        w_again = None if weight is None else weight[again]
        m_new, a_new, c_new = _bucket_pass(x_again, w_again, m_again, target[again], above[again], hi, lo)
        member[again], above[again], count[again] = m_new, a_new, c_new
    width = max(1, int(count.max()))
    cand = x.masked_fill(~member, float("-inf")).topk(width, dim=1).values  # descending
    valid = torch.arange(width, device=x.device).unsqueeze(0) < count.unsqueeze(1)
    if weight is None:
        cand_w = valid.to(x.dtype)
    else:
        # The same float ops as the weights summed above (exp(x - max)), so the sums agree.
        cand_w = (cand - row_max.unsqueeze(1)).exp_().masked_fill_(~valid, 0.0)
    return _rank_candidates(cand, cand_w, valid, above, target)


def _rank_candidates(cand: torch.Tensor, cand_w: torch.Tensor, valid: torch.Tensor, above: torch.Tensor,
                     target: torch.Tensor) -> torch.Tensor:
    """cand [n, c] descending (valid: a prefix of each row), cand_w their weights (0 where not valid), above the
    weight of the tokens above them -> the smallest candidate whose weight strictly above is < target."""
    exclusive = cand_w.cumsum(1) - cand_w
    # Weight strictly above a candidate: everything before the first of its ties.
    neg = (-cand).contiguous()
    first_tie = torch.searchsorted(neg, neg, right=False)
    strictly_above = above.unsqueeze(1) + exclusive.gather(1, first_tie)
    kept = (strictly_above < target.unsqueeze(1)) & valid
    num_kept = kept.sum(1).clamp_(min=1)
    return cand.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)


def top_k_top_p_cutoff_prefix(logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
                              width: int = _PREFIX, whole_rows: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The cutoffs from each row's `width` largest logits (torch.topk, a partial selection) without a host sync:
    (cutoff [N], exact [N] bool). The rows not exact need the whole row (`apply_top_k_top_p_prefix` sorts them).

    A row reads only its own first `bound` values, so its result depends on its own logits and parameters, not on
    a wider prefix another row asked for (a seeded request draws the same token whatever the batch):
      * top-k (k <= width, else not exact): the k-th value; with top-p, the bound is k: the set's mass is the
        prefix's k values plus, counted over the row, the ties with the k-th value past them (they are in the set
        and weigh what the k-th does), and a crossing not found in the k values puts the cutoff at the k-th value.
        Always exact.
      * top-p over the whole row: the bound is min(width, _PREFIX); the mass is summed over the row; exact when
        the crossing lies within the bound (or the bound holds the whole row). whole_rows=False: the caller needs
        no such row exact (every top-p row it cares about has a top-k), which saves the pass over the row."""
    n, vocab = logits.shape
    w = min(vocab, width)
    vals = logits.topk(w, dim=1).values  # descending
    cutoff = logits.new_full((n,), float("-inf"))
    exact = torch.ones(n, dtype=torch.bool, device=logits.device)
    has_k = None
    if top_k is not None:
        has_k = top_k < vocab
        k = top_k.clamp(1, w)
        kth = vals.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
        cutoff = torch.where(has_k, kth, cutoff)
        exact &= ~has_k | (top_k <= w)
    if top_p is not None:
        has_p = top_p < 1.0
        pos = torch.arange(w, device=logits.device)
        bound = torch.full((n,), min(w, _PREFIX) if w < vocab else w, dtype=torch.int64, device=logits.device)
        if has_k is not None:
            bound = torch.where(has_k, k, bound)
        top = vals[:, :1]
        e = (vals - top).exp_().masked_fill_(pos >= bound.unsqueeze(1), 0.0)
        cum = e.cumsum(dim=1)
        mass = cum[:, -1]
        if w < vocab and whole_rows:
            mass = (logits - top).exp_().sum(dim=1)  # the rows without top-k: the whole row
        if has_k is not None:
            ties = (logits >= kth.unsqueeze(1)).sum(dim=1) - k  # past the k values, tied with the k-th
            set_mass = cum[:, -1] + ties * (kth - top.squeeze(1)).exp()
            mass = torch.where(has_k, set_mass, mass)
        # Kept: the positions whose mass strictly above (the exclusive sum) is below p x mass, a prefix of each row.
        kept = (((cum - e) < (top_p * mass).unsqueeze(1)) & (pos < bound.unsqueeze(1))).sum(dim=1)
        cut = vals.gather(1, (kept - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        cutoff = torch.where(has_p, torch.maximum(cut, cutoff), cutoff)
        settled = ((kept < bound) & (whole_rows or w == vocab)) | (bound >= vocab)
        if has_k is not None:
            settled |= has_k
        exact &= ~has_p | settled
    return cutoff, exact


def top_k_top_p_cutoff_sort(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                            top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """The sort-based cutoffs (the reference): sort each row once (ascending), apply top-k, then drop the low tail
    whose total mass is <= 1 - p; the smallest kept logit is the row's cutoff [N]."""
    vocab = logits.shape[1]
    sorted_logits = logits.sort(dim=-1, descending=False).values  # [N, V]
    cutoff = logits.new_full((logits.shape[0], 1), float("-inf"))
    if top_k is not None:
        cutoff = sorted_logits.gather(1, (vocab - top_k.clamp(max=vocab)).unsqueeze(1))  # k-th largest value
        sorted_logits.masked_fill_(sorted_logits < cutoff, float("-inf"))
    if top_p is not None:
        cum_probs = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        # The most likely token always stays.
        num_dropped = (cum_probs <= (1.0 - top_p).unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(max=vocab - 1)
        cutoff = sorted_logits.gather(1, num_dropped)
    return cutoff.squeeze(1)


def apply_top_k_top_p_prefix(logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
                             max_top_k: int = 0, top_p_within_top_k: bool = False) -> torch.Tensor:
    """Mask, in place, every logit outside its row's top-k / top-p set by the prefix cutoffs. max_top_k (a host
    int, 0: unknown) widens the prefix to the batch's largest top-k. top_p_within_top_k (host knowledge: every row
    with a top-p also has a top-k) makes every row exact with a prefix of max_top_k values and no host sync;
    otherwise the rows the prefix cannot settle are sorted (one host sync: whether there are any)."""
    if top_p_within_top_k and top_k is not None and max_top_k > 0:
        cutoff, _ = top_k_top_p_cutoff_prefix(logits, top_k, top_p, width=max_top_k, whole_rows=False)
        return mask_below(logits, cutoff)
    cutoff, exact = top_k_top_p_cutoff_prefix(logits, top_k, top_p, width=max(_PREFIX, max_top_k))
    if not bool(exact.all()):
        rows = (~exact).nonzero().squeeze(1)
        cutoff[rows] = top_k_top_p_cutoff_sort(logits[rows], None if top_k is None else top_k[rows],
                                               None if top_p is None else top_p[rows])
    return mask_below(logits, cutoff)


def mask_below(logits: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """Set every logit below its row's cutoff to -inf, in place."""
    return logits.masked_fill_(logits < cutoff.unsqueeze(1), float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Mask, in place, every logit outside its row's top-k / top-p set (module docstring) to -inf."""
    return mask_below(logits, top_k_top_p_cutoff_torch(logits, top_k, top_p))
