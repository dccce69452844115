"""Sampler: exact supports, greedy == argmax, seeded reproducibility, penalties vs a reference loop."""
import math

import pytest
import torch

from pagedllm.layers.sampler import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams

V = 32
DEVICE = "cpu"  # the `device` fixture switches it; tests build their inputs on the CPU


@pytest.fixture(autouse=True, params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    globals()["DEVICE"] = request.param
    yield request.param
    globals()["DEVICE"] = "cpu"


def build(params, prompts=None, outputs=None, eos=None, vocab=V):
    n = len(params)
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    eos = eos if eos is not None else [None] * n
    return SamplingMetadata.build(params, prompts, outputs, eos, vocab, DEVICE)


class _CpuOutput:
    """SamplerOutput with its tensors moved back to the CPU for the assertions."""

    def __init__(self, out):
        self.sampled_token_ids = out.sampled_token_ids.cpu()
        self.logprobs = None if out.logprobs is None else tuple(t.cpu() for t in out.logprobs)


def sample(logits, params, **kw):
    return run_sampler(logits.clone(), build(params, **kw))


def run_sampler(logits, meta):
    return _CpuOutput(Sampler()(logits.to(DEVICE), meta))


def repeat_rows(row_logits, times):
    return row_logits.unsqueeze(0).expand(times, -1).contiguous()


def test_all_greedy_is_argmax_with_ties_like_torch():
    torch.manual_seed(0)
    logits = torch.randn(8, V)
    logits[3, 5] = logits[3, 9] = logits[3].max() + 1.0  # tie: first index wins
    meta = build([SamplingParams(temperature=0.0)] * 8)
    assert meta.all_greedy and meta.temperature is None and meta.no_penalties
    out = run_sampler(logits.clone(), meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids[3].item() == 5
    assert out.logprobs is None


def test_mixed_batch_greedy_rows_take_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=3)] * 3
    meta = build(params)
    assert not meta.all_greedy and not meta.all_random
    out = run_sampler(logits.clone(), meta)
    greedy_rows = [0, 2, 4]
    assert torch.equal(out.sampled_token_ids[greedy_rows], logits[greedy_rows].argmax(-1))


def allowed_tokens_top_p(row, p):
    probs = row.softmax(-1)
    order = probs.argsort(descending=True)
    keep, mass = [], 0.0
    for t in order.tolist():
        keep.append(t)
        mass += probs[t].item()
        if mass >= p:
            break
    return set(keep)


@pytest.mark.parametrize("kind", ["top_k", "top_p", "min_p", "top_k_top_p"])
def test_filters_restrict_support_exactly(kind):
    torch.manual_seed(2)
    # Well separated logits so that float rounding cannot move a boundary.
    row = torch.linspace(4.0, -4.0, V)[torch.randperm(V)]
    probs = row.softmax(-1)
    order = probs.argsort(descending=True).tolist()
    if kind == "top_k":
        params, allowed = SamplingParams(top_k=5), set(order[:5])
    elif kind == "top_p":
        params, allowed = SamplingParams(top_p=0.6), allowed_tokens_top_p(row, 0.6)
    elif kind == "min_p":
        params = SamplingParams(min_p=0.2)
        allowed = {t for t in range(V) if probs[t] >= 0.2 * probs.max()}
    else:
        params = SamplingParams(top_k=6, top_p=0.9)
        top6 = row.clone()
        top6[order[6:]] = float("-inf")
        allowed = allowed_tokens_top_p(top6, 0.9)
    assert 1 < len(allowed) < V
    n = 4000
    out = sample(repeat_rows(row, n), [params] * n)
    seen = set(out.sampled_token_ids.tolist())
    assert seen <= allowed
    assert seen == allowed or len(seen) >= len(allowed) - 1  # rare tail tokens may be missed


def test_temperature_sampling_matches_distribution():
    torch.manual_seed(3)
    row = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4))
    n = 20000
    for temp in (0.5, 2.0):
        out = sample(repeat_rows(row, n), [SamplingParams(temperature=temp)] * n)
        freq = torch.bincount(out.sampled_token_ids, minlength=V).float() / n
        expected = (row / temp).softmax(-1)
        assert torch.allclose(freq, expected, atol=0.015), (temp, freq[:4], expected[:4])


def test_masked_tokens_never_sampled_even_at_high_temperature():
    row = torch.zeros(V)
    n = 5000
    params = [SamplingParams(temperature=5.0, top_k=2)] * n
    row[7], row[11] = 1.0, 0.5
    out = sample(repeat_rows(row, n), params)
    assert set(out.sampled_token_ids.tolist()) == {7, 11}


def test_seeded_rows_reproduce_across_batches_and_positions():
    torch.manual_seed(4)
    row = torch.randn(V)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=0.8, top_p=0.9)
    greedy = SamplingParams(temperature=0.0)
    history = [3, 1]  # output position 2

    def run(batch_params, batch_outputs, seeded_row):
        n = len(batch_params)
        logits = torch.randn(n, V)
        logits[seeded_row] = row
        out = sample(logits, batch_params, outputs=batch_outputs)
        return out.sampled_token_ids[seeded_row].item()

    alone = run([seeded], [history], 0)
    in_batch = run([other, greedy, seeded, other], [[], [5], history, [1, 2, 3]], 2)
    # Random global RNG state must not matter either.
    torch.manual_seed(999)
    again = run([greedy, seeded], [[], history], 1)
    assert alone == in_batch == again
    # Many seeds: the draw depends on the seed and on the position.
    draws_by_seed = set()
    for seed in range(40):
        p = SamplingParams(temperature=1.0, seed=seed)
        draws_by_seed.add(run([p], [history], 0))
    assert len(draws_by_seed) > 5
    p = SamplingParams(temperature=1.0, seed=7)
    by_position = {run([p], [[0] * pos], 0) for pos in range(40)}
    assert len(by_position) > 5


def reference_penalties(logits, prompt, output, rep, freq, pres):
    out = logits.clone()
    seen = set(prompt) | set(output)
    for t in seen:
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def test_penalties_match_reference_loop():
    torch.manual_seed(5)
    logits = torch.randn(5, V) * 3
    prompts = [[1, 2, 3], [4, 4], [], [9, 10, 11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8]]
    outputs = [[3, 3, 5], [], [6, 6, 6, 7], [13, 14], [1, 1, 2]]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, presence_penalty=0.7),
        SamplingParams(temperature=0.0, frequency_penalty=1.1, presence_penalty=-0.3),
        SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=0.5),
        SamplingParams(temperature=0.0),  # no penalty: untouched
    ]
    from pagedllm.layers.sampler import apply_penalties

    meta = build(params, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits.clone().to(DEVICE), meta).cpu()
    for i, p in enumerate(params):
        ref = reference_penalties(logits[i], prompts[i], outputs[i], p.repetition_penalty,
                                  p.frequency_penalty, p.presence_penalty)
        assert torch.allclose(got[i], ref, atol=1e-5), i
    # And greedy picks the argmax of the penalized logits.
    out = run_sampler(logits.clone(), meta)
    assert torch.equal(out.sampled_token_ids, got.argmax(-1))


def test_no_penalty_tensors_when_unused():
    meta = build([SamplingParams(), SamplingParams(temperature=0)], prompts=[[1, 2], [3]], outputs=[[4], []])
    assert meta.no_penalties and meta.prompt_token_ids is None and meta.output_token_ids is None
    meta = build([SamplingParams(presence_penalty=0.5)], prompts=[[1, 2]], outputs=[[4]])
    assert meta.prompt_token_ids is None and meta.output_token_ids is not None  # no repetition penalty


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(3, V)
    logits[:, 2] = 10.0  # eos
    logits[:, 8] = 9.0  # a stop token id
    logits[:, 4] = 1.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8]),
        SamplingParams(temperature=0.0, min_tokens=1),
    ]
    outputs = [[5], [5, 5, 5], []]
    out = sample(logits, params, outputs=outputs, eos=[2, 2, 2])
    assert out.sampled_token_ids.tolist() == [4, 2, 8]
    # Random rows too.
    n = 2000
    out = sample(repeat_rows(logits[0], n), [SamplingParams(min_tokens=2, stop_token_ids=[8])] * n,
                 outputs=[[]] * n, eos=[2] * n)
    assert not ({2, 8} & set(out.sampled_token_ids.tolist()))


def test_logprobs_are_raw_log_softmax_with_ranks():
    torch.manual_seed(6)
    logits = torch.randn(5, V)
    params = [SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.7),
              SamplingParams(temperature=1.0, top_k=4, logprobs=1),
              SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.0, logprobs=0),
              SamplingParams(temperature=0.0, logprobs=3, presence_penalty=2.0)]
    outputs = [[int(logits[0].argmax())], [], [], [], [int(logits[4].argmax())]]
    out = sample(logits, params, outputs=outputs)
    ids, lps, ranks = out.logprobs
    assert ids.shape == lps.shape == ranks.shape == (5, 4)
    raw = logits.log_softmax(-1)
    assert torch.equal(ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(lps, raw.gather(1, ids))
    top = raw.topk(3, dim=-1)
    assert torch.equal(ids[:, 1:], top.indices)
    assert ranks[:, 1:].tolist() == [[1, 2, 3]] * 5
    for i in range(5):
        sampled = ids[i, 0].item()
        expected_rank = int((raw[i] > raw[i, sampled]).sum()) + 1
        assert ranks[i, 0].item() == expected_rank
    # Penalized greedy rows did not take the raw argmax, so their rank is > 1.
    assert ranks[0, 0].item() > 1 and ranks[4, 0].item() > 1


def test_logprobs_zero_only_sampled():
    logits = torch.randn(2, V)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 2)
    ids, lps, ranks = out.logprobs
    assert ids.shape == (2, 1) and ranks.tolist() == [[1], [1]]
    assert torch.allclose(lps[:, 0], logits.log_softmax(-1).max(-1).values)


def test_top_k_larger_than_vocab_and_all_filters_mixed():
    torch.manual_seed(7)
    logits = torch.randn(4, V)
    params = [SamplingParams(top_k=V + 100), SamplingParams(top_k=1), SamplingParams(top_p=0.01),
              SamplingParams(min_p=1.0)]
    out = sample(logits, params)
    top1 = logits.argmax(-1)
    assert out.sampled_token_ids[1:].tolist() == top1[1:].tolist()
    assert 0 <= out.sampled_token_ids[0].item() < V


def test_bfloat16_logits_are_accepted():
    logits = torch.randn(3, V).to(torch.bfloat16)
    out = run_sampler(logits, build([SamplingParams(temperature=0.0)] * 3))
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert math.isfinite(out.sampled_token_ids.float().sum().item())
