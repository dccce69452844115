"""Cases of the one-kernel device sampler (kernels/sampling.py), shared by Triton's interpreter on the CPU
(interpret_sampling.py, small draws) and the H200 (tests/gpu/test_device_sampling_gpu.py, large draws).

The reference distribution is the sampler's own CPU path taken step by step: temperature, min_p, then top-k / top-p
by the sort-based reference (`apply_top_k_top_p_sort`), then softmax, in float64. Each draw is a fixed function
of its seeds, so a case passes or fails the same way every run."""
from __future__ import annotations

import math

import torch

from pagedllm.kernels.sampling import sample_rows
from pagedllm.layers.sampler import apply_min_p, apply_top_k_only, apply_top_k_top_p_sort, top_k_threshold

STEP_SEED = (1 << 40) + 12345


def llm_row(vocab: int, seed: int = 0, ties: bool = True) -> torch.Tensor:
    """A language-model-like row: a normal body and a few lifted tokens; with ties, two pairs of equal logits among
    the top (top-k / top-p cutoffs that fall on a tie must keep the whole tie)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=gen)
    top = torch.randperm(vocab, generator=gen)[:6]
    x[top] += torch.tensor([3.0, 2.6, 2.2, 2.0, 1.6, 1.4])
    if ties:
        x[top[3]] = x[top[2]]
        x[top[5]] = x[top[4]]
    return x


def reference_probs(row: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> torch.Tensor:
    """float64 [V]: the distribution the sampler's reference path draws from for one row."""
    vocab = row.numel()
    x = (row.double() / temperature).unsqueeze(0).float()
    if min_p > 0:
        x = apply_min_p(x, torch.tensor([min_p]))
    k = torch.tensor([top_k if 0 < top_k < vocab else vocab])
    if top_p < 1.0:
        x = apply_top_k_top_p_sort(x, k if 0 < top_k < vocab else None, torch.tensor([top_p]))
    elif 0 < top_k < vocab:
        x = apply_top_k_only(x, k, top_k)
    return torch.softmax(x[0].double(), 0)


def kth_cutoff(logits: torch.Tensor, top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """What `sampler.sample_on_device` passes for a small top-k: the k-th largest raw logit (-inf: no top-k)."""
    return top_k_threshold(logits, top_k, int(top_k[top_k < vocab].max())).squeeze(1)


def draw(row: torch.Tensor, n: int, device: str, temperature: float, top_k: int = 0, top_p: float = 1.0,
         min_p: float = 0.0, k_as_cutoff: bool = False) -> torch.Tensor:
    """n unseeded draws from one row repeated n times (each row its own key) -> token ids [n]."""
    vocab = row.numel()
    logits = row.to(device).repeat(n, 1).contiguous()
    full = lambda v: torch.full((n,), v, dtype=torch.float32, device=device)  # noqa: E731
    kwargs = {}
    if min_p > 0:
        kwargs["min_p"] = full(min_p)
    if top_p < 1.0:
        kwargs["top_p"] = full(top_p)
    if 0 < top_k < vocab:
        ks = torch.full((n,), top_k, dtype=torch.int64, device=device)
        if k_as_cutoff:
            kwargs["cutoff"] = kth_cutoff(logits, ks, vocab)
        else:
            kwargs["top_k"] = ks
    return sample_rows(logits, full(temperature), STEP_SEED, **kwargs)


def check_distribution(row: torch.Tensor, n: int, device: str, sigmas: float = 5.0, **params) -> float:
    """Draws against the reference: no token outside the kept set, every frequency within `sigmas` standard
    errors of its probability, and Pearson's chi-square over the kept tokens below a 1e-4 tail bound.
    -> the chi-square statistic per degree of freedom (for the log)."""
    probs = reference_probs(row, params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0),
                            params.get("min_p", 0.0))
    tokens = draw(row, n, device, **params).cpu()
    counts = torch.bincount(tokens, minlength=row.numel()).double()
    outside = counts[probs == 0].sum().item()
    assert outside == 0, f"{params}: {outside:.0f} draws outside the kept set"
    freq = counts / n
    bound = sigmas * (probs * (1 - probs) / n).sqrt() + 1.0 / n
    worst = ((freq - probs).abs() - bound).max().item()
    assert worst <= 0, f"{params}: a frequency off by more than {sigmas} sigma: {freq.tolist()} vs {probs.tolist()}"
    kept = probs > 0
    dof = int(kept.sum()) - 1
    if dof == 0:
        return 0.0
    expected = probs[kept] * n
    chi2 = (((counts[kept] - expected) ** 2) / expected).sum().item()
    # Wilson-Hilferty: chi2 / dof is about normal with mean 1 - 2 / (9 dof) and variance 2 / (9 dof).
    z = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    assert z < 3.72, f"{params}: chi-square {chi2:.1f} over {dof} degrees of freedom (z = {z:.2f})"
    return chi2 / dof


DISTRIBUTION_CASES = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=0.8, top_k=3),  # the cutoff falls on a tie: both tied tokens stay
    dict(temperature=0.9, top_k=5, top_p=0.8, k_as_cutoff=True),  # Qwen-style: top-p within the top-k set
    dict(temperature=1.0, min_p=0.1, top_p=0.9),
    dict(temperature=1.3, top_k=1),  # many rejection rounds: only the max passes
    dict(temperature=2.0, top_p=0.95),
]
INTERPRETER_CASES = [DISTRIBUTION_CASES[i] for i in (0, 1, 3, 4)]


def check_greedy_rows(device: str) -> None:
    """Rows at temperature 0 take torch.argmax of the raw logits (the first index of a tie), whatever the other rows
    of the batch ask for, and never look at noise or filters."""
    vocab = 300
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=gen)
    logits[1, 17] = logits[1, 250] = 9.0  # a tie: index 17 wins
    logits[4] = float("-inf")
    logits[4, 123] = -5.0
    temperature = torch.tensor([0.0, 0.0, 0.9, 0.0, 0.0, 1.0])
    top_p = torch.tensor([0.1, 0.5, 0.9, 1.0, 0.2, 0.5])
    out = sample_rows(logits.to(device), temperature.to(device), STEP_SEED, top_p=top_p.to(device),
                      min_p=torch.full((6,), 0.5, device=device)).cpu()
    want = logits.argmax(dim=1)
    for r in (0, 1, 3, 4):
        assert out[r] == want[r], (r, out[r], want[r])
    assert out[1] == 17 and out[4] == 123


def check_non_finite_rows(device: str) -> None:
    """A row with +inf or NaN logits ends (no endless rejection rounds) and returns a column of the row; an +inf
    logit wins the draw as it wins the argmax."""
    vocab = 100
    logits = torch.stack([llm_row(vocab, seed=s) for s in range(4)])
    logits[0, 7] = float("inf")
    logits[1, 3] = float("nan")
    logits[2, :] = float("nan")
    logits[3, 11] = float("inf")
    n = logits.shape[0]
    out = sample_rows(logits.to(device), torch.full((n,), 0.8, device=device), STEP_SEED,
                      top_p=torch.full((n,), 0.9, device=device), min_p=torch.full((n,), 0.1, device=device),
                      top_k=torch.full((n,), 5, dtype=torch.int64, device=device)).cpu()
    assert ((out >= 0) & (out < vocab)).all(), out
    assert out[0] == 7 and out[3] == 11, out


def check_masked_and_seeded(device: str, vocab: int = 1000) -> None:
    """-inf logits are never drawn; a seeded row's token is a function of its key alone (any batch position or
    company); without keys, rows differ from one step seed to the next."""
    row = llm_row(vocab, seed=5) * 0.2  # flat: many tokens have a real chance
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[::5] = True
    masked = row.masked_fill(~allowed, float("-inf"))
    n = 32
    tokens = sample_rows(masked.to(device).repeat(n, 1).contiguous(), torch.full((n,), 1.0, device=device),
                         STEP_SEED).cpu()
    assert allowed[tokens].all(), tokens
    assert len(set(tokens.tolist())) > 8  # different rows, different keys

    keys = [11, 22, 33, 44]
    alone = []
    for key in keys:
        out = sample_rows(row.to(device).unsqueeze(0).contiguous(), torch.ones(1, device=device), STEP_SEED,
                          seeds=torch.tensor([key], device=device))
        alone.append(int(out[0]))
    others = llm_row(vocab, seed=9)
    batch = torch.stack([others, row, others, row, row, others, row, others])
    seeds = torch.tensor([-1, 11, -1, 22, 33, -1, 44, -1])
    temps = torch.tensor([0.5, 1.0, 0.0, 1.0, 1.0, 2.0, 1.0, 0.7])
    for step_seed in (STEP_SEED, STEP_SEED + 99):
        out = sample_rows(batch.to(device), temps.to(device), step_seed, seeds=seeds.to(device)).cpu()
        assert out[[1, 3, 4, 6]].tolist() == alone, (out.tolist(), alone)
    a = sample_rows(batch.to(device), temps.to(device), STEP_SEED).cpu()
    b = sample_rows(batch.to(device), temps.to(device), STEP_SEED + 1).cpu()
    c = sample_rows(batch.to(device), temps.to(device), STEP_SEED).cpu()
    assert torch.equal(a, c)
    assert not torch.equal(a, b)


def check_split_rows_match_one_program(device: str, vocab: int = 300, n: int = 40) -> None:
    """A few rows with temperature alone (seeded or not) take the split variant, each row cut between programs:
    its tokens are the one-program kernel's, token for token (the same score per column, the same first index of a
    tie), for greedy, +inf, NaN and fully masked rows too, in fp32 and bf16. `n` rows in the largest batch: the six
    special rows above, then plain rows cycling through temperatures 0 / 0.5 / 1 / 1.5, every third one seeded
    (n >= 14 meets each temperature twice and seeded rows greedy and not)."""
    import pagedllm.kernels.sampling as kernel

    assert n >= 14, n
    logits = torch.stack([llm_row(vocab, seed=s) * 0.3 for s in range(n)])
    logits[0, 17] = logits[0, vocab - 3] = 50.0  # greedy row with a tie across parts: 17 wins
    logits[1, :] = float("-inf")
    logits[1, vocab - 1] = 0.0  # the only candidate, in the last part
    logits[2, :] = float("-inf")  # nothing to draw: 0
    logits[3, vocab // 2] = float("inf")
    logits[4, 5] = float("nan")
    logits[5, ::3] = float("-inf")
    temps = torch.tensor([0.0, 1.0, 0.7, 0.9, 1.1, 2.0] + [(0.0, 0.5, 1.0, 1.5)[i % 4] for i in range(n - 6)])
    seeds = torch.tensor([-1 if i % 3 else 1000 + i for i in range(n)])
    assert kernel.SPLIT_MAX_ROWS >= n
    default = kernel.SPLIT_MAX_ROWS
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(device=device, dtype=dtype)
        for rows in (1, 3, n):
            for step_seed, with_seeds in ((STEP_SEED, False), (STEP_SEED + 7, True)):
                args = (x[:rows], temps[:rows].to(device), step_seed)
                kw = {"seeds": seeds[:rows].to(device)} if with_seeds else {}
                split = sample_rows(*args, **kw).cpu()
                kernel.SPLIT_MAX_ROWS = 0
                try:
                    one = sample_rows(*args, **kw).cpu()
                finally:
                    kernel.SPLIT_MAX_ROWS = default
                assert torch.equal(split, one), (dtype, rows, with_seeds, split.tolist(), one.tolist())
                assert split[0] == 17
                if rows > 3:
                    assert split[1] == vocab - 1 and split[2] == 0 and split[3] == vocab // 2
                    assert split[4] != 5 and split[5] % 3 != 0
