"""Scheduler: exact per-step plans under a token budget, preemption, stops, aborts, prefix sharing.

A FakeRunner plays the model runner: it keeps its own per-request state built only from plan diffs
(as the real runner must) and samples token `1000 + position` unless a script says otherwise.
"""
import random
import subprocess
import sys

import pytest

from pagedllm.core.batch_plan import ModelOutput, TokenLogprobs
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

BS = 4


def make_sched(**kw):
    args = dict(max_num_seqs=16, max_num_batched_tokens=100, max_model_len=1000, block_size=BS,
                num_blocks=64, enable_prefix_caching=True)
    args.update(kw)
    return Scheduler(**args)


def make_req(rid, tokens, max_tokens=16, eos=None, **params):
    if isinstance(tokens, int):  # n tokens private to this request id (no accidental prefix hits)
        base = 100_000 + 1000 * (int.from_bytes(rid.encode(), "little") % 997)
        tokens = list(range(base, base + tokens))
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, **params), eos_token_id=eos)


class FakeRunner:
    def __init__(self, scripts=None):
        self.scripts = scripts or {}  # rid -> list of tokens to sample, in order
        self.state = {}

    def execute(self, plan):
        for rid in plan.finished_request_ids:
            self.state.pop(rid, None)
        for new in plan.new_requests:
            assert new.request_id not in self.state
            self.state[new.request_id] = {
                "tokens": list(new.token_ids), "blocks": list(new.block_ids), "computed": new.num_computed_tokens,
            }
        for cached in plan.cached_requests:
            s = self.state[cached.request_id]
            assert s["computed"] == cached.num_computed_tokens
            s["blocks"] += cached.new_block_ids
        out = ModelOutput()
        for rid, n in plan.num_scheduled_tokens.items():
            s = self.state[rid]
            s["computed"] += n
            # Slots for every computed token, and no more blocks than that needs.
            assert s["computed"] <= len(s["tokens"]) and s["computed"] <= len(s["blocks"]) * BS
            assert len(s["blocks"]) == -(-s["computed"] // BS)
            sampled = []
            if s["computed"] == len(s["tokens"]):
                script = self.scripts.get(rid)
                tok = script.pop(0) if script else 1000 + len(s["tokens"])
                s["tokens"].append(tok)
                sampled = [tok]
            out.req_ids.append(rid)
            out.sampled_token_ids.append(sampled)
            out.logprobs.append(None)
        return out


def step(sched, runner):
    plan = sched.schedule()
    assert plan.total_num_scheduled_tokens == sum(plan.num_scheduled_tokens.values())
    output = runner.execute(plan)
    for rid, s in runner.state.items():  # the runner's block tables mirror the scheduler's
        if rid in sched.requests:
            assert s["blocks"] == sched.kv_cache_manager.get_block_ids(rid)
    return plan, {o.request_id: o for o in sched.update_from_output(plan, output)}


def run_to_completion(sched, runner, max_steps=1000):
    outs = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        _, step_outs = step(sched, runner)
        for rid, o in step_outs.items():
            outs.setdefault(rid, []).extend(o.new_token_ids)
    raise AssertionError("did not finish")


# ---------------------------------------------------------------- basics


def test_single_request_prefill_then_decode_to_max_tokens():
    sched, runner = make_sched(), FakeRunner()
    r = make_req("a", range(6), max_tokens=3)
    sched.add_request(r)
    assert sched.num_waiting == 1 and sched.has_unfinished_requests()
    plan, outs = step(sched, runner)
    assert [n.request_id for n in plan.new_requests] == ["a"]
    assert plan.new_requests[0].token_ids == list(range(6))
    assert plan.new_requests[0].block_ids == [0, 1] and plan.new_requests[0].num_computed_tokens == 0
    assert plan.num_scheduled_tokens == {"a": 6} and plan.cached_requests == []
    assert r.num_computed_tokens == 6 and r.first_scheduled_time is not None
    assert outs["a"].new_token_ids == [1006] and not outs["a"].finished
    assert r.first_token_time is not None
    plan, outs = step(sched, runner)
    assert plan.new_requests == [] and plan.num_scheduled_tokens == {"a": 1}
    assert plan.cached_requests[0].num_computed_tokens == 6 and plan.cached_requests[0].new_block_ids == []
    plan, outs = step(sched, runner)
    assert outs["a"].new_token_ids == [1008] and outs["a"].finish_reason == "length"
    assert r.output_token_ids == [1006, 1007, 1008] and r.status == RequestStatus.FINISHED_LENGTH
    assert sched.num_running == 0 and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == 64
    plan = sched.schedule()
    assert plan.is_empty and plan.finished_request_ids == {"a"}
    assert sched.update_from_output(plan, ModelOutput()) == []


def test_empty_schedule_and_pool_tokens():
    sched = make_sched(num_blocks=10)
    assert sched.num_pool_tokens == 40
    plan = sched.schedule()
    assert plan.is_empty and plan.new_requests == [] and plan.finished_request_ids == set()


def test_add_request_rejects_duplicates_and_empty_prompts():
    sched = make_sched()
    sched.add_request(make_req("a", 3))
    with pytest.raises(ValueError):
        sched.add_request(make_req("a", 3))
    with pytest.raises(ValueError):
        sched.add_request(make_req("b", []))


def test_new_block_ids_when_crossing_block_boundary():
    sched, runner = make_sched(), FakeRunner()
    sched.add_request(make_req("a", 7, max_tokens=5))
    step(sched, runner)  # 7 tokens -> blocks [0, 1]; samples token 8
    plan, _ = step(sched, runner)  # computes token index 7: still block 1
    assert plan.cached_requests[0].new_block_ids == []
    plan, _ = step(sched, runner)  # computes token index 8: needs block 2
    assert plan.cached_requests[0].new_block_ids == [2]
    assert plan.cached_requests[0].num_computed_tokens == 8


# ---------------------------------------------------------------- token budget


def test_chunked_prefill_three_requests_budget_10():
    sched, runner = make_sched(max_num_batched_tokens=10), FakeRunner()
    for rid, n in (("A", 7), ("B", 5), ("C", 12)):
        sched.add_request(make_req(rid, n, max_tokens=50))
    expected = [
        {"A": 7, "B": 3},
        {"A": 1, "B": 2, "C": 7},
        {"A": 1, "B": 1, "C": 5},
        {"A": 1, "B": 1, "C": 1},
    ]
    got = []
    sampled = []
    for _ in expected:
        plan, outs = step(sched, runner)
        got.append(plan.num_scheduled_tokens)
        sampled.append(sorted(outs))
    assert got == expected
    assert [list(d) for d in got] == [list(d) for d in expected]  # batch order: running first
    assert sampled == [["A"], ["A", "B"], ["A", "B", "C"], ["A", "B", "C"]]


def test_mid_prefill_request_is_not_new_twice_and_gets_no_output():
    sched, runner = make_sched(max_num_batched_tokens=5), FakeRunner()
    sched.add_request(make_req("a", 12, max_tokens=2))
    plan, outs = step(sched, runner)
    assert [n.request_id for n in plan.new_requests] == ["a"] and outs == {}
    plan, outs = step(sched, runner)
    assert plan.new_requests == [] and plan.cached_requests[0].num_computed_tokens == 5
    assert plan.num_scheduled_tokens == {"a": 5} and outs == {}
    plan, outs = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 2} and outs["a"].new_token_ids == [1012]


def test_token_sampled_mid_prefill_is_ignored():
    sched = make_sched(max_num_batched_tokens=5)
    r = make_req("a", 12)
    sched.add_request(r)
    plan = sched.schedule()
    outs = sched.update_from_output(plan, ModelOutput(["a"], [[77]], [None]))
    assert outs == [] and r.output_token_ids == []


def test_decodes_before_new_requests():
    sched, runner = make_sched(max_num_batched_tokens=8), FakeRunner()
    sched.add_request(make_req("old", 4, max_tokens=10))
    step(sched, runner)
    sched.add_request(make_req("new", 20, max_tokens=10))
    plan, _ = step(sched, runner)
    assert list(plan.num_scheduled_tokens.items()) == [("old", 1), ("new", 7)]
    assert [c.request_id for c in plan.cached_requests] == ["old"]
    assert [n.request_id for n in plan.new_requests] == ["new"]


def test_running_requests_beyond_budget_wait_their_turn():
    sched, runner = make_sched(max_num_batched_tokens=3), FakeRunner()
    for rid in "abc":
        sched.add_request(make_req(rid, 1, max_tokens=10))
    step(sched, runner)
    sched.add_request(make_req("d", 1))
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    assert sched.num_waiting == 1


def test_max_num_seqs():
    sched, runner = make_sched(max_num_seqs=2), FakeRunner()
    sched.add_request(make_req("a", 4, max_tokens=1))
    sched.add_request(make_req("b", 4, max_tokens=3))
    sched.add_request(make_req("c", 4, max_tokens=3))
    plan, outs = step(sched, runner)
    assert list(plan.num_scheduled_tokens) == ["a", "b"] and sched.num_waiting == 1
    assert outs["a"].finished and sched.num_running == 1
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"b": 1, "c": 4} and plan.finished_request_ids == {"a"}


def test_long_prefill_token_threshold():
    sched, runner = make_sched(long_prefill_token_threshold=4), FakeRunner()
    sched.add_request(make_req("a", 10, max_tokens=5))
    sched.add_request(make_req("b", 3, max_tokens=5))
    plans = [step(sched, runner)[0].num_scheduled_tokens for _ in range(3)]
    assert plans == [{"a": 4, "b": 3}, {"a": 4, "b": 1}, {"a": 2, "b": 1}]


# ---------------------------------------------------------------- preemption


def test_preempt_newest_then_resume_as_new_request_with_all_tokens():
    sched = make_sched(num_blocks=4, enable_prefix_caching=False)
    runner = FakeRunner()
    a, b = make_req("A", range(7), max_tokens=4), make_req("B", range(10, 17), max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    plan, _ = step(sched, runner)
    assert [n.block_ids for n in plan.new_requests] == [[0, 1], [2, 3]]
    step(sched, runner)  # both decode inside their second block
    plan, outs = step(sched, runner)  # A needs a 3rd block: B (newest) is preempted
    assert plan.num_scheduled_tokens == {"A": 1}
    assert plan.preempted_request_ids == {"B"} and plan.finished_request_ids == {"B"}
    assert plan.cached_requests[0].new_block_ids == [3]  # B's tail block, freed first
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.stats().num_preemptions == 1
    assert list(sched.waiting) == [b] and "B" not in outs
    plan, outs = step(sched, runner)  # B does not fit yet: A alone
    assert plan.num_scheduled_tokens == {"A": 1} and outs["A"].finish_reason == "length"
    plan, outs = step(sched, runner)
    (new,) = plan.new_requests
    assert new.request_id == "B" and new.num_computed_tokens == 0
    assert new.token_ids == list(range(10, 17)) + [1007, 1008] and new.num_prompt_tokens == 7
    assert new.block_ids == [2, 3, 1]
    assert plan.num_scheduled_tokens == {"B": 9} and plan.finished_request_ids == {"A"}
    assert outs["B"].new_token_ids == [1009] and outs["B"].finish_reason == "length"
    assert a.output_token_ids == [1007, 1008, 1009, 1010]
    assert b.output_token_ids == [1007, 1008, 1009]


def test_preemption_order_newest_first_and_self_preemption():
    sched = make_sched(num_blocks=3, enable_prefix_caching=False)
    runner = FakeRunner()
    reqs = [make_req(rid, 4, max_tokens=5) for rid in "ABC"]
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)  # one full block each; pool exhausted
    plan, _ = step(sched, runner)
    # A preempts C and takes its block; B then needs a block and is itself the newest: preempted.
    assert plan.num_scheduled_tokens == {"A": 1}
    assert plan.preempted_request_ids == {"B", "C"}
    assert [r.request_id for r in sched.waiting] == ["B", "C"]
    assert sched.num_running == 1 and sched.stats().num_preemptions == 2
    outs = run_to_completion(sched, runner)
    assert all(r.output_token_ids == [1004, 1005, 1006, 1007, 1008] for r in reqs)
    assert set(outs) == {"A", "B", "C"}


def test_no_admission_in_a_step_with_preemption():
    sched = make_sched(num_blocks=3, enable_prefix_caching=False)
    runner = FakeRunner()
    sched.add_request(make_req("A", 4, max_tokens=5))
    sched.add_request(make_req("B", 8, max_tokens=5))
    step(sched, runner)
    plan, _ = step(sched, runner)  # A preempts B; B is not re-admitted in the same step
    assert plan.num_scheduled_tokens == {"A": 1} and plan.new_requests == []


def test_resumed_request_hits_its_own_cached_blocks():
    sched = make_sched(num_blocks=4)
    runner = FakeRunner()
    sched.add_request(make_req("A", range(7), max_tokens=4))
    b = make_req("B", range(10, 17), max_tokens=3)
    sched.add_request(b)
    for _ in range(4):
        step(sched, runner)  # same as the no-cache test: B preempted in step 3, A done in step 4
    plan, _ = step(sched, runner)
    (new,) = plan.new_requests
    # B's first block (2) survived in the cache; its second (3) was evicted for A.
    assert new.num_computed_tokens == 4 and new.block_ids == [2, 3, 1]
    assert plan.num_scheduled_tokens == {"B": 5}
    assert b.num_cached_tokens == 0  # set on first scheduling only


def test_only_request_that_cannot_grow_finishes_with_length():
    sched = make_sched(num_blocks=2)
    runner = FakeRunner()
    r = make_req("a", 7, max_tokens=10)
    sched.add_request(r)
    step(sched, runner)
    step(sched, runner)  # 8 slots: pool (2 blocks) full
    plan, outs = step(sched, runner)
    assert plan.is_empty and sched.num_running == 0
    assert plan.finished_request_ids == {"a"}  # the runner drops it with this very plan
    assert outs["a"].finish_reason == "length" and outs["a"].new_token_ids == []
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [1007, 1008]
    assert sched.kv_cache_manager.num_free_blocks == 2 and sched.stats().num_preemptions == 0
    assert sched.schedule().finished_request_ids == set()


def test_waiting_request_larger_than_pool_finishes_with_length():
    sched = make_sched(num_blocks=2)
    runner = FakeRunner()
    sched.add_request(make_req("big", 9))
    sched.add_request(make_req("ok", 3, max_tokens=1))
    plan, outs = step(sched, runner)
    assert plan.num_scheduled_tokens == {"ok": 3}
    assert outs["big"].finish_reason == "length" and outs["big"].new_token_ids == []
    assert outs["ok"].finished and not sched.has_unfinished_requests()


def test_waiting_request_waits_while_pool_busy():
    sched = make_sched(num_blocks=3)
    runner = FakeRunner()
    sched.add_request(make_req("a", 8, max_tokens=2))
    sched.add_request(make_req("b", 8, max_tokens=1))
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 8} and sched.num_waiting == 1
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 1}
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"b": 8} and plan.new_requests[0].block_ids == [2, 1]


# ---------------------------------------------------------------- aborts


def test_abort_running_frees_blocks_at_once():
    sched, runner = make_sched(num_blocks=8), FakeRunner()
    sched.add_request(make_req("a", 9, max_tokens=10))
    sched.add_request(make_req("b", 3, max_tokens=10))
    step(sched, runner)
    assert sched.kv_cache_manager.num_free_blocks == 4
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_free_blocks == 7 and sched.num_running == 1
    assert "a" not in sched.requests
    plan, outs = step(sched, runner)
    assert plan.finished_request_ids == {"a"} and list(plan.num_scheduled_tokens) == ["b"]
    assert "a" not in outs


def test_abort_waiting_and_unknown_ids():
    sched, runner = make_sched(), FakeRunner()
    r = make_req("a", 3)
    sched.add_request(r)
    sched.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED)
    assert r.status == RequestStatus.FINISHED_ABORTED and not sched.has_unfinished_requests()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # twice: ignored
    plan = sched.schedule()
    assert plan.is_empty and plan.finished_request_ids == {"a"}
    with pytest.raises(ValueError):
        sched.finish_requests(["a"], RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_drops_output():
    sched, runner = make_sched(), FakeRunner()
    r = make_req("a", 3)
    sched.add_request(r)
    plan = sched.schedule()
    output = runner.execute(plan)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)  # e.g. a stop string
    assert sched.update_from_output(plan, output) == []
    assert r.output_token_ids == [] and r.status == RequestStatus.FINISHED_STOPPED


# ---------------------------------------------------------------- stop conditions


def run_script(script, max_model_len=1000, prompt=4, **kw):
    sched = make_sched(max_model_len=max_model_len)
    runner = FakeRunner({"a": list(script)})
    r = make_req("a", prompt, **kw)
    sched.add_request(r)
    outs = []
    while sched.has_unfinished_requests():
        _, o = step(sched, runner)
        outs.append(o["a"])
    return r, outs


def test_eos_stops():
    r, outs = run_script([5, 2, 7], eos=2)
    assert r.output_token_ids == [5, 2] and outs[-1].finish_reason == "stop"
    assert outs[-1].stop_reason is None and r.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos():
    r, outs = run_script([5, 2, 7], eos=2, ignore_eos=True, max_tokens=3)
    assert r.output_token_ids == [5, 2, 7] and outs[-1].finish_reason == "length"


def test_min_tokens_delays_eos_and_stop_tokens():
    r, outs = run_script([2, 9, 2, 9], eos=2, min_tokens=3, stop_token_ids=[9])
    assert r.output_token_ids == [2, 9, 2] and outs[-1].finish_reason == "stop"


def test_stop_token_ids_set_stop_reason():
    r, outs = run_script([5, 6, 7, 8], stop_token_ids=[7])
    assert r.output_token_ids == [5, 6, 7]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == 7 and r.stop_reason == 7


def test_engine_extra_stop_ids_in_all_stop_token_ids():
    r, outs = run_script([5, 6], all_stop_token_ids={6})
    assert r.output_token_ids == [5, 6] and outs[-1].stop_reason == 6


def test_max_tokens():
    r, outs = run_script([], max_tokens=2)
    assert r.output_token_ids == [1004, 1005] and [o.finish_reason for o in outs] == [None, "length"]


def test_max_model_len():
    r, outs = run_script([], max_model_len=6, max_tokens=100)
    assert r.output_token_ids == [1004, 1005] and outs[-1].finish_reason == "length"


def test_eos_on_last_allowed_token_reports_stop():
    r, outs = run_script([5, 2], eos=2, max_tokens=2)
    assert outs[-1].finish_reason == "stop"


def test_multi_token_step_drops_tokens_after_stop_and_truncates_logprobs():
    sched = make_sched()
    r = make_req("a", 4, eos=2)
    sched.add_request(r)
    plan = sched.schedule()
    lps = [TokenLogprobs([t], [-0.5], [1]) for t in (5, 2, 9)]
    (out,) = sched.update_from_output(plan, ModelOutput(["a"], [[5, 2, 9]], [lps]))
    assert out.new_token_ids == [5, 2] and out.new_logprobs == lps[:2]
    assert out.finish_reason == "stop" and r.output_token_ids == [5, 2]


def test_logprobs_carried_through():
    sched = make_sched()
    sched.add_request(make_req("a", 4))
    plan = sched.schedule()
    lp = [TokenLogprobs([5, 3], [-0.1, -2.0], [1, 2])]
    (out,) = sched.update_from_output(plan, ModelOutput(["a"], [[5]], [lp]))
    assert out.new_logprobs == lp and out.num_cached_tokens == 0


# ---------------------------------------------------------------- prefix caching


def test_prefix_sharing_across_steps_counts_hits():
    sched, runner = make_sched(), FakeRunner()
    prompt = list(range(20))
    sched.add_request(make_req("a", prompt))
    plan, _ = step(sched, runner)
    assert plan.new_requests[0].block_ids == [0, 1, 2, 3, 4]
    b = make_req("b", prompt)
    sched.add_request(b)
    plan, outs = step(sched, runner)
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 16 and new.block_ids == [0, 1, 2, 3, 6]
    assert plan.num_scheduled_tokens == {"a": 1, "b": 4}
    assert b.num_cached_tokens == 16 and outs["b"].num_cached_tokens == 16
    assert outs["b"].new_token_ids == [1020]
    st = sched.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (40, 16)


def test_prefix_sharing_within_one_step():
    sched, runner = make_sched(), FakeRunner()
    prompt = list(range(20))
    sched.add_request(make_req("a", prompt))
    sched.add_request(make_req("b", prompt))
    plan, _ = step(sched, runner)
    # b hits the blocks a is computing in this very step (registered at allocation).
    assert [n.num_computed_tokens for n in plan.new_requests] == [0, 16]
    assert plan.num_scheduled_tokens == {"a": 20, "b": 4}
    assert [n.block_ids for n in plan.new_requests] == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 5]]


def test_prefix_caching_disabled_never_hits():
    sched, runner = make_sched(enable_prefix_caching=False), FakeRunner()
    sched.add_request(make_req("a", 20))
    sched.add_request(make_req("b", 20))
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == {"a": 20, "b": 20}
    assert sched.stats().prefix_cache_queries == 0


def test_stats_and_reset_prefix_cache():
    sched, runner = make_sched(num_blocks=10), FakeRunner()
    sched.add_request(make_req("a", range(8), max_tokens=1))
    sched.add_request(make_req("b", range(9), max_tokens=2))
    step(sched, runner)
    st = sched.stats()
    assert (st.num_running, st.num_waiting) == (1, 0)
    assert st.kv_cache_usage == pytest.approx(0.3)  # b holds blocks 0, 1 (shared, hit) and 3
    assert sched.reset_prefix_cache() is False
    run_to_completion(sched, runner)
    assert sched.stats().kv_cache_usage == 0.0
    assert sched.reset_prefix_cache() is True
    sched.add_request(make_req("c", range(9)))
    plan, _ = step(sched, runner)
    assert plan.new_requests[0].num_computed_tokens == 0


# ---------------------------------------------------------------- simulation


@pytest.mark.parametrize("caching", [True, False])
def test_random_workload_under_memory_pressure(caching):
    rng = random.Random(0)
    sched = make_sched(num_blocks=24, max_num_batched_tokens=32, max_num_seqs=6,
                       enable_prefix_caching=caching)
    runner = FakeRunner()
    shared = [rng.randrange(500) for _ in range(12)]
    reqs = []
    for i in range(30):
        prompt = shared[: rng.randrange(13)] + [rng.randrange(500) for _ in range(rng.randrange(1, 20))]
        reqs.append(make_req(f"r{i}", prompt, max_tokens=rng.randrange(1, 15)))
    pending = list(reqs)
    pool = sched.kv_cache_manager.block_pool
    seen_states = set()
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        step(sched, runner)
        # the pool's per-block state bytes (the dashboard's grid) agree with the blocks themselves
        assert pool.block_states == block_states_of(pool)
        seen_states.update(pool.block_states)
    assert not pending and not sched.has_unfinished_requests()
    assert seen_states == ({0, 1, 2, 3} if caching else {0, 2})
    for r in reqs:
        n = r.num_prompt_tokens
        assert r.output_token_ids == [1000 + n + k for k in range(r.max_tokens)]
        assert r.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv_cache_manager.num_free_blocks == 24
    st = sched.stats()
    assert st.num_preemptions > 0 and (st.prefix_cache_hits > 0) == caching


def block_states_of(pool):
    """The reference for BlockPool.block_states: one walk over the blocks."""
    from pagedllm.core.block_pool import CACHED, FREE, SHARED, USED

    return bytearray(SHARED if b.ref_cnt > 1 else USED if b.ref_cnt == 1 else CACHED if b.block_hash is not None
                     else FREE for b in pool.blocks)


def test_core_never_imports_torch():
    code = (
        "import sys, pagedllm.core.scheduler, pagedllm.core.kv_cache_manager;"
        "assert 'torch' not in sys.modules, 'core imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- enable_chunked_prefill=False


@pytest.mark.parametrize("chunked", [True, False])
def test_without_chunked_prefill_a_prompt_runs_whole_or_waits(chunked):
    sched, runner = make_sched(max_num_batched_tokens=10, enable_chunked_prefill=chunked), FakeRunner()
    sched.add_request(make_req("a", 6, max_tokens=3))
    sched.add_request(make_req("b", 8, max_tokens=3))
    plan, _ = step(sched, runner)
    # chunked: b's first 4 tokens fill the budget; unchunked: b waits for a step with room for all 8
    assert plan.num_scheduled_tokens == ({"a": 6, "b": 4} if chunked else {"a": 6})
    plan, _ = step(sched, runner)
    assert plan.num_scheduled_tokens == ({"a": 1, "b": 4} if chunked else {"a": 1, "b": 8})
    run_to_completion(sched, runner)
    assert not sched.has_unfinished_requests()
    if not chunked:  # no step ever scheduled part of a prompt
        sched.add_request(make_req("c", 9, max_tokens=2))
        plan, _ = step(sched, runner)
        assert plan.num_scheduled_tokens == {"c": 9}


def test_longrope_request_held_out_leaves_no_other_alone_in_the_pool():
    """LongRoPE with async scheduling: a request crossing the original context with a token in flight is held out
    of `running` for a step, its blocks still taken. A request then alone in `running` that finds the pool full
    must wait (preempted), not be finished as one that can never grow (it was: "length" with no token)."""
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=BS, num_blocks=3,
                  enable_prefix_caching=False, async_scheduling=True, long_rope_original=8)
    a = make_req("a", 8, max_tokens=4)  # 2 blocks; its first token crosses position 8: recomputed with long factors
    b = make_req("b", 4, max_tokens=6)  # 1 block, full: its first decode needs a new one
    s.add_request(a)
    s.add_request(b)
    prev, token, preempted = None, 500, set()
    for _ in range(100):
        plan = s.schedule()
        preempted |= plan.preempted_request_ids
        if prev is not None:  # the step in flight's result comes after the next plan (async scheduling)
            ids = list(prev.num_scheduled_tokens)
            sampled = [[token + i] for i in range(len(ids))]
            s.update_from_output(prev, ModelOutput(req_ids=ids, sampled_token_ids=sampled))
            token += len(ids)
        prev = plan
        if a.is_finished and b.is_finished:
            break
    assert preempted >= {"a", "b"}  # a recomputed past the boundary, b waited for a's blocks
    assert (len(a.output_token_ids), len(b.output_token_ids)) == (4, 6)  # each to its max_tokens
    assert s.kv_cache_manager.num_free_blocks == 3
