"""Speculative decoding parts on their own: config validation, n-gram lookup, the rejection sampler's
distribution, scheduler accounting (drafts as tokens to compute, rollback of rejected drafts), metrics."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from pagedllm.core.batch_plan import ModelOutput
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.layers.sampler import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.rejection_sampler import NO_DRAFT, accepted_tokens, emitted_counts, rejection_sample


# ---------------------------------------------------------------- config

def test_config_parses_vllm_forms():
    c = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4, 4)
    c = SpeculativeConfig.from_user('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    c = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 8})  # neither: one to four tokens
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 4)
    c = SpeculativeConfig.from_user({"model": "/x", "num_speculative_tokens": 5})
    assert c.method == "draft_model" and c.model == "/x"
    assert SpeculativeConfig.from_user(None) is None


@pytest.mark.parametrize("value, message", [
    ({"method": "bogus", "num_speculative_tokens": 2}, "method"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "not supported yet"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, ">="),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "draft_model", "model": ["a.gguf"], "num_speculative_tokens": 2}, "'model' must be a path"),
    ({"model": 7, "num_speculative_tokens": 2}, "'model' must be a path"),
    ({"method": "ngram", "num_speculative_tokens": 2, "colour": "red"}, "Unknown speculative_config key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ("{not json", "JSON"),
    (["ngram"], "dict"),
])
def test_config_errors(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_user(value)


def test_engine_args_and_cli_flag():
    from pagedllm.config import EngineArgs
    from pagedllm.entrypoints.cli.main import build_parser

    args = build_parser().parse_args(["serve", "m", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'])
    from pagedllm.entrypoints.openai.cli_args import to_engine_args

    ea = to_engine_args(args)
    ea.validate()
    assert ea.speculative().num_speculative_tokens == 4
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(speculative_config={"method": "ngram"}).validate()
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    for pooling in (dict(runner="pooling"), dict(convert="embed"), dict(task="classify")):  # was silently ignored
        with pytest.raises(ValueError, match="speculative_config with a pooling runner"):
            EngineArgs(model="m", speculative_config=spec, **pooling).validate()


# ---------------------------------------------------------------- n-gram

def test_ngram_proposes_continuation_of_latest_match():
    prop = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    seqs = [[1, 2, 3, 4, 5, 9, 9, 2, 3],  # suffix [2, 3] (3-gram [9, 2, 3] absent) -> after index 1: 4 5 9
            [7, 8, 9, 7, 8, 6, 1, 7, 8],  # latest earlier [7, 8] at 3 -> 6 1 7
            [1, 2, 3, 4, 5, 6, 7, 8, 9],  # no repeat -> nothing
            [5, 6, 5, 6, 5, 6, 0, 0, 0]]  # length 6 (rest is padding): latest earlier [5, 6] at 2 -> 5 6
    mat = np.zeros((4, 16), dtype=np.int64)
    for i, s in enumerate(seqs):
        mat[i, :len(s)] = s
    drafts = prop.propose(mat, [0, 1, 2, 3], [9, 9, 9, 6], [3, 3, 3, 3])
    assert drafts == [[4, 5, 9], [6, 1, 7], [], [5, 6]]
    # room limits the proposal
    assert prop.propose(mat, [0], [9], [1]) == [[4]]
    assert prop.propose(mat, [0], [9], [0]) == [[]]


def test_ngram_prefers_longer_match():
    prop = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
    seq = [4, 1, 2, 3, 8, 9, 2, 3, 5, 5, 1, 2, 3]  # 3-gram [1, 2, 3] at 1 -> 8 9 (1-gram [3] would give 5 5)
    mat = np.array([seq], dtype=np.int64)
    assert prop.propose(mat, [0], [len(seq)], [2]) == [[8, 9]]


def test_ngram_index_equals_full_scan_as_sequences_grow():
    """The per-request incremental index proposes exactly what the full sliding-window scan does, step after step
    (several tokens appended per step, as after accepted drafts), with the same request ids in different rows,
    a request moved to another row (rebuilt) and requests dropped."""
    rng = np.random.default_rng(0)
    for lo, hi, vocab in [(2, 4, 3), (1, 3, 5), (3, 3, 2)]:
        prop = NgramProposer(num_speculative_tokens=4, prompt_lookup_min=lo, prompt_lookup_max=hi)
        mat = np.full((6, 400), -7, dtype=np.int64)  # garbage past each length, as drafts leave in the runner
        lens = [int(rng.integers(1, 12)) for _ in range(5)]
        rows = [0, 1, 2, 3, 4]
        for r, n in zip(rows, lens):
            mat[r, :n] = rng.integers(0, vocab, n)
        ids = [f"r{i}" for i in range(5)]
        for step in range(60):
            rooms = [int(rng.integers(0, 6)) for _ in rows]
            got = prop.propose(mat, rows, lens, rooms, req_ids=ids)
            assert got == prop.propose_scan(mat, rows, lens, rooms), (lo, hi, step)
            for i, r in enumerate(rows):
                n = int(rng.integers(1, 6))
                mat[r, lens[i]:lens[i] + n] = rng.integers(0, vocab, n)
                lens[i] += n
            if step == 20:  # request 2 moves to row 5 (preempted and resumed elsewhere)
                mat[5, :lens[2]] = mat[2, :lens[2]]
                rows[2] = 5
            if step == 30:  # request 4 finishes; a new request of the same id starts in its row
                prop.drop(["r4"])
                lens[4] = 3
                mat[4, :3] = rng.integers(0, vocab, 3)
        assert set(prop._index) == set(ids)


# ---------------------------------------------------------------- rejection sampler

def _meta(n, vocab, **kw):
    return SamplingMetadata.build(params=[SamplingParams(**kw)] * n, prompt_token_ids=[[0]] * n,
                                  output_token_ids=[[]] * n, eos_token_ids=[None] * n, vocab_size=vocab, device="cpu")


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=p.numel()).double() / samples.numel()
    return 0.5 * float((freq - p.double()).abs().sum())


TARGET = torch.tensor([2.0, 0.5, 1.0, -1.0, 0.0])  # p = softmax: a known 5-token target
N = 40_000


def test_rejection_sampling_with_one_hot_draft_preserves_target():
    torch.manual_seed(0)
    p = TARGET.softmax(-1)
    logits = TARGET.repeat(N, 1)
    drafts = torch.full((N,), 3, dtype=torch.long)  # always propose an unlikely token
    out = rejection_sample(logits.clone(), _meta(N, 5, temperature=1.0), drafts)
    assert _tv(out.final_token_ids, p) < 0.01
    # accepted exactly when the emitted token is the draft; acceptance rate ~ p(draft)
    assert torch.equal(out.accepted, out.final_token_ids == 3)
    assert abs(out.accepted.double().mean().item() - p[3].item()) < 0.01


def test_rejection_sampling_uses_draft_distribution():
    """Drafts drawn from q != p: the output is p, and a draft is accepted with min(1, p/q), i.e. at the rate
    sum(min(p, q)) (treating the draft as one-hot instead would accept at the rate E_q[p])."""
    torch.manual_seed(1)
    p = TARGET.softmax(-1)
    q = torch.tensor([0.05, 0.6, 0.05, 0.25, 0.05])
    drafts = torch.multinomial(q, N, replacement=True)
    logits = TARGET.repeat(N, 1)
    out = rejection_sample(logits.clone(), _meta(N, 5, temperature=1.0), drafts, draft_probs=q.repeat(N, 1))
    assert _tv(out.final_token_ids, p) < 0.01
    rate, expected, one_hot_rate = out.accepted.double().mean().item(), torch.minimum(p, q).sum().item(), (p * q).sum()
    assert abs(rate - expected) < 0.01 and abs(expected - one_hot_rate.item()) > 0.1
    # a sampler that ignored q in the residual (resampling from p after a rejection) would be biased:
    residual_ignored = torch.where(out.accepted, drafts, torch.multinomial(p, N, replacement=True))
    assert _tv(residual_ignored, p) > 0.05


def test_rejection_sampling_honours_temperature_and_top_k():
    torch.manual_seed(2)
    logits = TARGET.repeat(N, 1)
    drafts = torch.full((N,), 2, dtype=torch.long)
    out = rejection_sample(logits.clone(), _meta(N, 5, temperature=0.5, top_k=2), drafts)
    p = torch.zeros(5)
    top = (TARGET / 0.5)[[0, 2]].softmax(-1)
    p[0], p[2] = top[0], top[1]
    assert _tv(out.final_token_ids, p) < 0.01


def test_bonus_rows_sample_target_and_greedy_rows_take_argmax():
    torch.manual_seed(3)
    logits = TARGET.repeat(N, 1)
    out = rejection_sample(logits.clone(), _meta(N, 5, temperature=1.0), torch.full((N,), NO_DRAFT))
    assert not out.accepted.any()
    assert _tv(out.final_token_ids, TARGET.softmax(-1)) < 0.01
    greedy = rejection_sample(TARGET.repeat(3, 1), _meta(3, 5, temperature=0.0), torch.tensor([0, 2, NO_DRAFT]))
    assert greedy.accepted.tolist() == [True, False, False]
    assert greedy.final_token_ids.tolist() == [0, 0, 0]


def test_seeded_rows_repeat():
    def run():
        metas = SamplingMetadata.build(params=[SamplingParams(temperature=1.0, seed=7)] * 4,
                                       prompt_token_ids=[[0]] * 4, output_token_ids=[[], [1], [1, 2], [1, 2, 3]],
                                       eos_token_ids=[None] * 4, vocab_size=5, device="cpu")
        return rejection_sample(TARGET.repeat(4, 1), metas, torch.tensor([3, 3, 3, NO_DRAFT])).final_token_ids
    torch.manual_seed(4)
    a = run()
    torch.manual_seed(5)
    assert torch.equal(a, run())


def test_accepted_tokens_per_request():
    # request 0: 3 drafts, first two accepted -> 2 drafts + correction; request 1: no drafts -> its bonus row
    accepted = [True, True, False, False, False]
    final = [10, 11, 99, 13, 42]
    assert accepted_tokens(accepted, final, [4, 1]) == [[10, 11, 99], [42]]
    assert accepted_tokens([True, True, False], [5, 6, 7], [3]) == [[5, 6, 7]]  # all accepted + bonus
    # a bonus row ends its request's run even if flagged: the next request's rows are its own
    assert accepted_tokens([True, True, True, False], [1, 2, 3, 4], [2, 2]) == [[1, 2], [3, 4]]


def test_emitted_counts_match_a_loop_over_requests():
    rng = np.random.default_rng(0)
    for _ in range(200):
        counts = rng.integers(1, 6, size=rng.integers(1, 8))
        starts = np.cumsum(counts) - counts
        accepted = rng.random(int(counts.sum())) < 0.7
        expected = []
        for s, n in zip(starts, counts):
            a = 0
            while a < n - 1 and accepted[s + a]:
                a += 1
            expected.append(a + 1)
        assert emitted_counts(accepted, starts, counts).tolist() == expected


# ---------------------------------------------------------------- scheduler accounting

def _scheduler(**kw):
    return Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=32,
                     num_speculative_tokens=4, spec_disable_batch_size=kw.pop("limit", 8), **kw)


def _request(rid="r", n=7, max_tokens=20):
    return Request(rid, list(range(2, 2 + n)), SamplingParams(temperature=0, max_tokens=max_tokens))


def test_drafts_are_scheduled_and_rejected_ones_rolled_back():
    s = _scheduler()
    req = _request()
    s.add_request(req)
    plan = s.schedule()  # prefill of 7 tokens: 2 blocks
    assert plan.num_scheduled_tokens == {"r": 7} and plan.propose_drafts
    s.update_from_output(plan, ModelOutput(req_ids=["r"], sampled_token_ids=[[50]], spec_token_ids=[[51, 52, 53, 54]]))
    assert req.spec_token_ids == [51, 52, 53, 54]
    plan = s.schedule()  # last token + 4 drafts: positions 7..11 -> 3 blocks
    assert plan.num_scheduled_tokens == {"r": 5}
    assert plan.scheduled_spec_decode_tokens == {"r": [51, 52, 53, 54]}
    assert len(s.kv_cache_manager.req_to_blocks["r"]) == 3 and req.num_computed_tokens == 12
    # one draft accepted, then the target's correction 60: 3 rejected
    s.update_from_output(plan, ModelOutput(req_ids=["r"], sampled_token_ids=[[51, 60]], spec_token_ids=[[]]))
    assert req.output_token_ids == [50, 51, 60]
    assert req.num_computed_tokens == 9 == req.num_tokens - 1
    assert len(s.kv_cache_manager.req_to_blocks["r"]) == 3  # positions 0..8 need 3 blocks: nothing to free
    stats = s.stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (1, 4, 1)
    assert stats.spec_num_accepted_tokens_per_pos == (1, 0, 0, 0)
    plan = s.schedule()  # no drafts proposed: plain decode
    assert plan.num_scheduled_tokens == {"r": 1} and not plan.scheduled_spec_decode_tokens


def test_rollback_frees_blocks_and_tells_the_runner():
    s = _scheduler()
    req = _request(n=8)
    s.add_request(req)
    plan = s.schedule()  # 8 tokens: exactly 2 blocks
    s.update_from_output(plan, ModelOutput(req_ids=["r"], sampled_token_ids=[[50]], spec_token_ids=[[1, 2, 3, 4]]))
    plan = s.schedule()  # positions 8..12 (token 50 + 4 drafts) -> blocks 3 and 4 appended
    assert len(plan.cached_requests[0].new_block_ids) == 2
    free_before = s.kv_cache_manager.num_free_blocks
    s.update_from_output(plan, ModelOutput(req_ids=["r"], sampled_token_ids=[[70]], spec_token_ids=[[5]]))
    # every draft rejected: K/V is valid for positions 0..8 only -> 3 blocks kept, the 4th freed
    assert req.num_computed_tokens == 9 and len(s.kv_cache_manager.req_to_blocks["r"]) == 3
    assert s.kv_cache_manager.num_free_blocks == free_before + 1
    plan = s.schedule()  # token 70 + draft 5: positions 9, 10 fit in 3 blocks; the runner cuts to 3 first
    cached = plan.cached_requests[0]
    assert cached.num_kept_blocks == 3 and cached.new_block_ids == []
    assert plan.scheduled_spec_decode_tokens == {"r": [5]}
    assert s.kv_cache_manager.block_pool.get_usage() > 0


def test_drafts_limited_by_max_tokens_and_turned_off_under_load():
    s = _scheduler(limit=1)
    req = _request(max_tokens=3)
    s.add_request(req)
    plan = s.schedule()
    s.update_from_output(plan, ModelOutput(req_ids=["r"], sampled_token_ids=[[50]], spec_token_ids=[[1, 2, 3, 4]]))
    plan = s.schedule()  # 1 output so far, max 3: at most 1 draft (+1 token) is worth verifying
    assert plan.scheduled_spec_decode_tokens == {"r": [1]}
    s.update_from_output(plan, ModelOutput(req_ids=["r"], sampled_token_ids=[[1, 9]], spec_token_ids=[[7]]))
    assert req.is_finished and req.output_token_ids == [50, 1, 9]
    # two requests with a limit of one: no speculation, and drafts are not even proposed
    for rid in ("a", "b"):
        s.add_request(_request(rid))
    plan = s.schedule()
    assert not plan.propose_drafts


def test_metrics_export_spec_counters():
    from pagedllm.core.scheduler import SchedulerStats
    from pagedllm.metrics import Metrics

    m = Metrics("m")
    zero = SchedulerStats(0, 0, 0.0, 0, 0, 0)
    now = SchedulerStats(0, 0, 0.0, 0, 0, 0, spec_num_drafts=3, spec_num_draft_tokens=12,
                         spec_num_accepted_tokens=7, spec_num_accepted_tokens_per_pos=(3, 2, 1, 1))
    m.update_scheduler_stats(now, zero)
    text = m.render().decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0' in text


def test_async_waits_for_the_step_in_flight_only_while_drafts_come():
    from types import SimpleNamespace

    from pagedllm.spec_decode.scheduling import SpecScheduling

    s = SpecScheduling(num_speculative_tokens=4, disable_by_batch_size=16, max_model_len=100)
    idle = [SimpleNamespace(spec_token_ids=[]), SimpleNamespace(spec_token_ids=[])]
    assert s.wants_sync(idle)  # nothing applied yet: a first proposing step is waited for
    s.note_proposals([[], []])  # the proposer found nothing: plain steps keep overlapping
    assert not s.wants_sync(idle)
    s.note_proposals(None)  # a step that proposed nothing (mid-prefill, speculation off)
    assert not s.wants_sync(idle)
    assert s.wants_sync([SimpleNamespace(spec_token_ids=[5, 6]), idle[0]])  # drafts held: never overlapped
    s.note_proposals([[], [7]])
    assert s.wants_sync(idle)


# ---------------------------------------------------------------- overlapped speculation (device drafts)

def test_device_ngram_proposes_what_the_host_scan_does():
    """propose_ngram (torch, one pass per n over [rows, width]) against the host proposer's full scan: random short
    histories over tiny vocabularies (many matches, ties, suffixes longer than the history)."""
    from pagedllm.spec_decode.device_ngram import propose_ngram

    rng = np.random.default_rng(0)
    for trial in range(300):
        num_rows, width = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        toks = rng.integers(0, int(rng.integers(2, 6)), size=(num_rows, width))
        lens = rng.integers(1, width + 1, size=num_rows)
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        ref = NgramProposer(k, lo, hi).propose_scan(toks, list(range(num_rows)), lens.tolist(), [k] * num_rows)
        drafts, counts = propose_ngram(torch.from_numpy(toks), torch.from_numpy(lens), k, lo, hi)
        assert [drafts[i, :counts[i]].tolist() for i in range(num_rows)] == ref, trial


def test_device_ngram_state_follows_the_emitted_tokens():
    """DeviceNgram over steps: new rows written, each step's verify rows appended up to their emitted counts (the
    rest is rejected), the next drafts proposed; always what the host proposer proposes on the same histories, and
    `before` returns the count each row had when the step was launched."""
    from pagedllm.spec_decode.device_ngram import DeviceNgram

    rng = np.random.default_rng(1)
    for lo, hi, vocab in [(1, 4, 3), (2, 2, 4)]:
        ng = DeviceNgram(max_reqs=6, max_model_len=160, k=4, min_n=lo, max_n=hi, device=torch.device("cpu"))
        host = NgramProposer(4, lo, hi)
        rows = [0, 3, 5]
        hist = {r: rng.integers(0, vocab, int(rng.integers(1, 9))).tolist() for r in rows}
        new = DeviceNgram.new_rows_arrays([(r, hist[r]) for r in rows])
        ng.write_new_rows(*(torch.from_numpy(a) for a in new))
        expected_before = [0, 0, 0]
        for step in range(25):
            counts = rng.integers(1, 5, size=3)
            emitted = np.array([int(rng.integers(1, c + 1)) for c in counts])
            tokens = rng.integers(0, vocab, int(counts.sum()))
            slot_req = np.repeat(np.arange(3), counts)
            slot_j = np.arange(len(slot_req)) - np.repeat(np.cumsum(counts) - counts, counts)
            before = ng.append_and_propose(torch.tensor(rows), torch.from_numpy(tokens), torch.from_numpy(slot_req),
                                           torch.from_numpy(slot_j), torch.from_numpy(emitted), width=160)
            assert before.tolist() == expected_before
            starts = np.cumsum(counts) - counts
            for i, r in enumerate(rows):
                hist[r] += tokens[starts[i]:starts[i] + emitted[i]].tolist()
            mat = np.zeros((6, 160), dtype=np.int64)
            for r in rows:
                mat[r, :len(hist[r])] = hist[r]
            ref = host.propose_scan(mat, rows, [len(hist[r]) for r in rows], [4] * 3)
            counts_now = ng.num_drafts[rows].tolist()
            assert [ng.drafts[r, :n].tolist() for r, n in zip(rows, counts_now)] == ref, (lo, hi, step)
            assert ng.lens[rows].tolist() == [len(hist[r]) for r in rows]
            expected_before = counts_now


def test_overlapped_verify_steps_plan_ahead_and_roll_back_one_step_late():
    """Async scheduling with device drafts: a verify step is planned while the previous one is in flight, at the
    positions of "all of its drafts accepted" (placeholders count 1 + drafts); the rollback of its rejected drafts
    comes with its result, trims the blocks past the true end of the step now in flight and tells the runner."""
    s = _scheduler(async_scheduling=True)
    s.spec.overlap = True
    req = _request(n=7, max_tokens=20)
    s.add_request(req)
    p0 = s.schedule()  # prefill
    assert p0.spec_overlap and req.num_output_placeholders == 1
    p1 = s.schedule()  # p0 in flight, its proposal unknown: a plain decode of p0's token
    assert p1.num_scheduled_tokens == {"r": 1} and not p1.scheduled_spec_decode_tokens
    s.update_from_output(p0, ModelOutput(req_ids=["r"], sampled_token_ids=[[50]], spec_token_ids=[[-1, -1]]))
    assert req.spec_token_ids == [-1, -1] and req.num_output_placeholders == 1
    p2 = s.schedule()  # p1 in flight: p1's token + 4 device drafts
    assert p2.spec_overlap and p2.scheduled_spec_decode_tokens == {"r": [-1] * 4}
    assert p2.num_scheduled_tokens == {"r": 5} and req.num_computed_tokens == 13 and req.num_output_placeholders == 6
    s.update_from_output(p1, ModelOutput(req_ids=["r"], sampled_token_ids=[[51]], spec_token_ids=[[-1, -1, -1]]))
    assert req.output_token_ids == [50, 51] and req.num_output_placeholders == 5
    p3 = s.schedule()  # p2 in flight (up to 5 tokens): planned after all of them
    assert p3.num_scheduled_tokens == {"r": 5} and req.num_computed_tokens == 18 and req.num_output_placeholders == 10
    assert len(s.kv_cache_manager.req_to_blocks["r"]) == 5
    # p2's result: 1 of its drafts accepted + the correction; 3 rejected. The device had proposed only 2 of the 4.
    s.update_from_output(p2, ModelOutput(req_ids=["r"], sampled_token_ids=[[60, 61]], spec_token_ids=[[-1] * 4],
                                         spec_num_drafts=[2]))
    assert req.output_token_ids == [50, 51, 60, 61] and req.num_output_placeholders == 5
    assert req.num_computed_tokens == 15  # p3 truly covers positions 10..14
    assert len(s.kv_cache_manager.req_to_blocks["r"]) == 4  # the 5th block held only rejected positions
    stats = s.stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (1, 2, 1)
    p4 = s.schedule()
    assert p4.cached_requests[0].num_kept_blocks == 4 and p4.num_scheduled_tokens == {"r": 5}
    # Near max_tokens (20) the room counts the step in flight as emitting all it can.
    s.update_from_output(p3, ModelOutput(req_ids=["r"], sampled_token_ids=[[1, 2, 3, 4, 5]], spec_token_ids=[[-1]],
                                         spec_num_drafts=[4]))
    assert len(req.output_token_ids) == 9 and req.num_output_placeholders == 5
    p5 = s.schedule()  # p4 may bring 9 + 5 = 14 outputs: 4 drafts still fit (14 + 5 <= 20)
    assert p5.scheduled_spec_decode_tokens == {"r": [-1] * 4}
    s.update_from_output(p4, ModelOutput(req_ids=["r"], sampled_token_ids=[[6, 7, 8, 9, 10]], spec_token_ids=[[-1]],
                                         spec_num_drafts=[4]))
    p6 = s.schedule()  # p5 may bring 14 + 5 = 19: its token only, no drafts
    assert p6.num_scheduled_tokens == {"r": 1} and not p6.scheduled_spec_decode_tokens
    assert s.schedule().num_scheduled_tokens == {}  # p5 and p6 may end the request: wait for a result
    s.update_from_output(p5, ModelOutput(req_ids=["r"], sampled_token_ids=[[11]], spec_token_ids=[[]],
                                         spec_num_drafts=[0]))
    assert req.num_output_placeholders == 1 and len(req.output_token_ids) == 15


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_overlapped_speculation_kernels_equal_their_torch_reference():
    """kernels/spec_decode.py (the CUDA path's two launches per step) in Triton's interpreter against the torch ops
    the CPU runs (interpret_spec_kernels.py: random greedy / sampled / plain steps, inputs in flight)."""
    from tests.triton_interpreter import run_interpreted

    assert "spec kernels ok" in run_interpreted(os.path.join(os.path.dirname(__file__), "interpret_spec_kernels.py"),
                                                timeout=600)


@pytest.mark.parametrize("windows", [(8,), (8, None)], ids=["one group", "sliding and full groups"])
def test_overlapped_verify_keeps_the_sliding_window_of_the_true_positions(windows):
    """A sliding window frees the blocks before what the next query sees. With a verify step in flight the next
    step is planned at "all its drafts accepted", up to its drafts ahead of where it truly runs: the blocks the
    true position still sees must stay (freeing by the planned one would hand a block the query reads to others)."""
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=64,
                  num_speculative_tokens=4, spec_disable_batch_size=8, async_scheduling=True, kv_group_windows=windows)
    s.spec.overlap = True
    req = _request(n=20, max_tokens=30)
    s.add_request(req)
    p0 = s.schedule()  # prefill, positions 0..19
    p1 = s.schedule()  # p0's token at 20
    s.update_from_output(p0, ModelOutput(req_ids=["r"], sampled_token_ids=[[50]], spec_token_ids=[[-1, -1]]))
    p2 = s.schedule()  # p1's token + 4 drafts: planned at 21..25
    assert p2.scheduled_spec_decode_tokens == {"r": [-1] * 4} and req.num_computed_tokens == 26
    s.update_from_output(p1, ModelOutput(req_ids=["r"], sampled_token_ids=[[51]], spec_token_ids=[[-1]]))
    s.schedule()  # planned at 26..30 (p2 all accepted); truly from 22 if p2 rejects all: keys from 15 (block 3)
    assert s.kv_cache_manager.group_freed[0].get("r", 0) <= 3


def test_overlap_falls_back_when_its_cuda_kernels_fail_at_start(monkeypatch, caplog):
    """If the overlapped-speculation kernels cannot compile or run on a GPU, the engine starts anyway with verify
    steps that wait (a warning says why) instead of failing."""
    from types import SimpleNamespace

    import pagedllm.kernels.spec_decode as kernels
    import pagedllm.spec_decode.device_ngram as device_ngram
    from pagedllm.spec_decode.spec_runner import SpecDecodeRunner

    def broken(*args, **kwargs):
        raise RuntimeError("PTX not supported")

    monkeypatch.setattr(kernels, "warm_up", broken)
    monkeypatch.setattr(device_ngram, "DeviceNgram", lambda *args: object())  # (no CUDA memory on this machine)
    config = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 3})
    spec = SpecDecodeRunner(config, NgramProposer(3, 2, 4), max_model_len=64)
    runner = SimpleNamespace(device=SimpleNamespace(type="cuda"), max_num_seqs=2, max_model_len=64, block_size=16)
    with caplog.at_level("WARNING"):
        assert spec.enable_device_ngram(runner) is False
    assert spec.device_ngram is None
    assert "PTX not supported" in caplog.text and "wait for the step before" in caplog.text


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0.6), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9)],
    [SamplingParams(temperature=0.7, top_k=5, logprobs=2), SamplingParams(temperature=0.3, min_p=0.1, top_p=0.8)],
    [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.0)],
])
def test_verify_rows_metadata_from_the_batch_arrays_equals_the_per_row_builder(params):
    """A verify step's sampling metadata from the runner's per-row arrays (each request's row repeated over its
    1 + drafts verify rows) is what the per-row builder makes, field by field."""
    from types import SimpleNamespace

    from pagedllm.spec_decode.spec_runner import SpecDecodeRunner
    from pagedllm.worker.sampling_batch import SamplingBatch, fast_metadata

    vocab = 50
    batch = SamplingBatch(8, vocab)
    batch_rows = np.array([5, 2, 7][:len(params)])
    drafts = {f"r{i}": [3] * d for i, d in enumerate([2, 0, 4][:len(params)])}
    for row, p in zip(batch_rows, params):
        batch.set_row(int(row), p)
    states = [SimpleNamespace(req_id=f"r{i}", sampling_params=p, prompt_token_ids=[1, 2, 3], output_token_ids=[4])
              for i, p in enumerate(params)]
    counts = np.array([len(drafts[s.req_id]) + 1 for s in states])
    step = batch.gather(np.repeat(batch_rows, counts))
    fast = fast_metadata(step, int(counts.sum()), vocab,
                         None if step.floats is None else torch.from_numpy(step.floats),
                         None if step.top_k is None else torch.from_numpy(step.top_k))
    runner = SimpleNamespace(eos_token_id=0, vocab_size=vocab, device=torch.device("cpu"))
    built = SpecDecodeRunner._row_metadata(runner, states, drafts)
    for name in ("num_rows", "all_greedy", "all_random", "max_top_k", "no_top_p", "no_top_k", "no_min_p",
                 "max_num_logprobs", "argmax_only"):
        assert getattr(fast, name) == getattr(built, name), name
    for name in ("temperature", "top_p", "top_k", "min_p"):
        a, b = getattr(fast, name), getattr(built, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a.to(b.dtype), b), name
    if not built.no_top_p and not built.no_top_k:
        assert fast.top_p_within_top_k == built.top_p_within_top_k
