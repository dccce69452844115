"""Comparing two engines' log-probabilities and greedy tokens within a stated bound (shared by the GGUF and FP8 KV
tests). Not a test module: pytest collects only test_*.py."""
from __future__ import annotations

from pagedllm import SamplingParams

TOP = 5  # log-probabilities per position compared (the top 5 and the chosen token)


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list:
    """Each prompt's greedy CompletionOutput, with the top-TOP log-probabilities of every position."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def teacher_forced(llm, ids: list[int]) -> list[dict]:
    """The top-TOP log-probabilities (and the actual next token's) at every position of ids after the first."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP)
    return llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].prompt_logprobs[1:]


def max_logprob_error(a: dict, b: dict) -> float:
    """Largest |difference| over the tokens two positions' log-probability dicts share (always the chosen one)."""
    return max(abs(a[t].logprob - b[t].logprob) for t in set(a) & set(b))


def assert_same_greedy(got: list, ref: list, atol: float) -> int:
    """Per prompt, position by position while the tokens so far agree: the log-probabilities within atol, and the
    same greedy token unless the reference's best two are a near-tie (closer than 2 * atol: each moves by at most
    atol, so only such a margin can flip). Past a differing token the contexts differ and nothing more is
    compared. Returns how many positions were compared."""
    compared = 0
    for p, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert len(g.token_ids) == len(r.token_ids), (p, len(g.token_ids), len(r.token_ids))
        for i, (a, b) in enumerate(zip(g.token_ids, r.token_ids)):
            err = max_logprob_error(g.logprobs[i], r.logprobs[i])
            assert err <= atol, f"prompt {p}, token {i}: log-probabilities differ by {err:.2e} (> {atol:.0e})"
            compared += 1
            if a != b:
                best = sorted((lp.logprob for lp in r.logprobs[i].values()), reverse=True)
                margin = best[0] - best[1]
                assert margin < 2 * atol, (f"prompt {p}, token {i}: greedy {a} vs {b} where the reference's margin "
                                           f"is {margin:.3g} nat, no near-tie")
                break
    return compared
