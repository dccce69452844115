"""Checks shared by the speculative-decoding GPU tests (test_spec_decode_gpu.py, test_verify_gpu.py). Not a test
module: pytest collects only test_*.py.

Greedy in bf16: two runs whose verify rows go through other kernels (5-token attention, GEMM instead of GEMV, graph
padding) round differently, so where the two most likely tokens are nearly tied they may pick different ones and
the texts differ from there on. `assert_same_up_to_near_ties` compares whole outputs anyway: token for token up to
the first difference, which must sit at a near-tie of the reference (its top-2 logprob margin < NEAR_TIE) and pick
the reference's runner-up; with logprobs, the logprob of every compared token within LP_TOL of the reference's. A
verify step that emits a wrong token (a draft accepted that is not the argmax, a wrong correction, logits of the
wrong positions) fails one of the three.

Sampling: `rank_fit` and `two_sample_chi2` test emitted tokens for distribution (temperature 1, no top-k)."""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

# bf16 noise: one bf16 forward's top-2 margin moves by <= 0.013 nat against fp32 on the tiny models (measured on
# the CPU with transformers); two bf16 runs twice that, and this leaves a factor of two.
NEAR_TIE = 0.05
LP_TOL = 0.05  # |logprob| difference of the same token at the same position between two bf16 runs
Z_LIMIT = 3.72  # one-sided normal quantile of p = 1e-4: the distribution tests' false alarm rate per statistic


def _top2_margin(logprobs: dict) -> float:
    values = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return values[0] - values[1]


def assert_same_up_to_near_ties(got: Sequence, want: Sequence, check_logprobs: bool = False) -> int:
    """got, want: CompletionOutputs of the same greedy requests; want requested logprobs=2 (got too if
    check_logprobs). Returns the number of tokens compared (the common prefixes)."""
    compared = 0
    for n, (g, w) in enumerate(zip(got, want)):
        assert len(g.token_ids) == len(w.token_ids), (n, len(g.token_ids), len(w.token_ids))
        d = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), len(w.token_ids))
        if d < len(w.token_ids):
            margin = _top2_margin(w.logprobs[d])
            assert margin < NEAR_TIE, (f"prompt {n}: first difference at {d} where the reference's top-2 margin is "
                                       f"{margin:.4f} (not a near-tie)", g.token_ids, w.token_ids)
            assert g.token_ids[d] in w.logprobs[d], (f"prompt {n}: at {d} {g.token_ids[d]} is not the reference's "
                                                     f"runner-up {sorted(w.logprobs[d])}")
        if check_logprobs:
            for i in range(d):
                t = w.token_ids[i]
                diff = abs(g.logprobs[i][t].logprob - w.logprobs[i][t].logprob)
                assert diff < LP_TOL, (f"prompt {n}, token {i}: logprob differs by {diff:.4f}", g.logprobs[i][t],
                                       w.logprobs[i][t])
        compared += d
    return compared


def chi2_limit(dof: int, z: float = Z_LIMIT) -> float:
    """Upper quantile of chi-square(dof) at the normal quantile z (Wilson-Hilferty; no scipy on the GPU machine)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def rank_fit(outputs: Sequence, positions: Sequence[int], top: int = 5) -> tuple[float, int, list[float]]:
    """Goodness of fit of the emitted tokens to the distribution the engine reports for them (logprobs=top,
    temperature 1, nothing filtered, so the reported logprobs are the sampling distribution): at every position,
    the emitted token is the i-th most likely with probability p_i. Bins: the top ranks and "any other"; expected
    counts sum p_i over all requests and positions. Returns (chi-square, dof, observed - expected per bin / sd)."""
    obs = [0.0] * (top + 1)
    exp = [0.0] * (top + 1)
    var = [0.0] * (top + 1)
    for out in outputs:
        for j in positions:
            ranked = sorted(out.logprobs[j].items(), key=lambda kv: (-kv[1].logprob, kv[0]))
            ranked = [(tok, lp) for tok, lp in ranked if lp.rank is not None and lp.rank <= top][:top]
            ids = [tok for tok, _ in ranked]
            emitted = out.token_ids[j]
            obs[ids.index(emitted) if emitted in ids else top] += 1
            probs = [math.exp(lp.logprob) for _, lp in ranked]
            probs += [0.0] * (top - len(probs)) + [max(0.0, 1.0 - sum(probs))]
            for i, p in enumerate(probs):
                exp[i] += p
                var[i] += p * (1 - p)
    bins = [i for i in range(top + 1) if exp[i] >= 5]
    stat = sum((obs[i] - exp[i]) ** 2 / exp[i] for i in bins)
    z = [(obs[i] - exp[i]) / math.sqrt(var[i]) if var[i] > 0 else 0.0 for i in range(top + 1)]
    return stat, len(bins) - 1, z


def two_sample_chi2(a: Sequence[int], b: Sequence[int], min_count: int = 20) -> tuple[float, int]:
    """Chi-square of two equally large samples of token ids drawn from one distribution (homogeneity): one bin per
    token seen >= min_count times in both together, the rest pooled. Returns (statistic, dof)."""
    assert len(a) == len(b)
    ca, cb = Counter(a), Counter(b)
    common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= min_count]
    pairs = [(ca[t], cb[t]) for t in common]
    rest = (len(a) - sum(x for x, _ in pairs), len(b) - sum(y for _, y in pairs))
    if sum(rest):
        pairs.append(rest)
    return sum((x - y) ** 2 / (x + y) for x, y in pairs), len(pairs) - 1


def mean_top_prob(outputs: Sequence, positions: Sequence[int]) -> float:
    """The mean probability of the most likely token at these positions (logprobs requested)."""
    ps = [math.exp(max(lp.logprob for lp in out.logprobs[j].values())) for out in outputs for j in positions]
    return sum(ps) / len(ps)


def peaked_model(src: str, dst: str, scale: float = 12.0) -> str:
    """The tiny model with its LM head scaled up: the next-token distributions concentrate (most likely token
    ~0.45, the top 5 ~0.8), so a few thousand samples show a sampler's bias."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * scale
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def check_overlapped_sampling(llm, seed_prompt: Sequence[int], num_requests: int = 2400) -> None:
    """Overlapped n-gram verify steps keep the sampling distribution: temperature 1, nothing filtered, unseeded (so
    the steps overlap), num_requests requests of 8 tokens; the prompt is the model's own greedy continuation of
    seed_prompt, so the lookup proposes tokens the model likes and a fair share is accepted. Every emitted token fits
    the distribution the engine reports for it (rank_fit), at the verified positions and the prefill's."""
    from pagedllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    seed_prompt = list(seed_prompt)
    prompt = seed_prompt + list(llm.generate([{"prompt_token_ids": seed_prompt}], greedy,
                                             use_tqdm=False)[0].outputs[0].token_ids)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": prompt}] * num_requests, params,
                                               use_tqdm=False)]
    assert all(len(o.token_ids) == 8 for o in outs)
    for positions in ([0], list(range(1, 8))):
        stat, dof, z = rank_fit(outs, positions)
        assert stat < chi2_limit(dof), (positions, stat, dof, z)
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 2000 and stats.num_accepted_tokens > 200
    assert llm.engine.worker.runner.spec.device_ngram.num_overlapped_steps > 0
