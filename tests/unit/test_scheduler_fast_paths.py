"""The scheduler's inline per-row fast paths (Scheduler.fast_paths) against its general path: the same plans and the
same outputs, step by step, on random workloads with stops, EOS, min_tokens, length limits, logprobs, preemption,
aborts, prefix caching, with and without async scheduling and chunked prefill, and with steps that propose drafts
for the next one (the requests' spec_token_ids after each step the same too)."""
import random

import pytest

from pagedllm.core.batch_plan import ModelOutput, TokenLogprobs
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

EOS, STOP = 7, 9


class Runner:
    """Per-request state from the plans' diffs only, as the model runner keeps it; samples a token that is a
    function of (request, position), EOS or a stop id now and then."""

    def __init__(self, seed: int, propose: bool = False):
        self.seed = seed
        self.state = {}
        self.propose = propose  # every step also proposes drafts per request (0-2 tokens), as a speculating runner

    def token(self, rid, position):
        r = random.Random(f"{self.seed}-{rid}-{position}").random()
        return EOS if r < 0.04 else STOP if r < 0.07 else 100 + int(r * 1000)

    def execute(self, plan):
        for rid in plan.finished_request_ids:
            self.state.pop(rid, None)
        for new in plan.new_requests:
            self.state[new.request_id] = [len(new.token_ids), new.num_computed_tokens]
        for cached in plan.cached_requests:
            self.state[cached.request_id][1] = cached.num_computed_tokens
        out = ModelOutput()
        for rid, n in plan.num_scheduled_tokens.items():
            s = self.state[rid]
            s[1] += n
            sampled = []
            if s[1] >= s[0]:
                sampled = [self.token(rid, s[0])]
                s[0] += 1
            out.req_ids.append(rid)
            out.sampled_token_ids.append(sampled)
            logprobs = None
            if sampled and rid.endswith("lp"):
                logprobs = [TokenLogprobs(sampled, [-0.5], [1])]
            out.logprobs.append(logprobs)
        if self.propose:
            out.spec_token_ids = [[100 + len(rid) + j for j in range(len(rid) % 3)] for rid in out.req_ids]
        return out


def plan_key(plan):
    return (
        [(n.request_id, n.token_ids, n.num_prompt_tokens, n.block_ids, n.num_computed_tokens) for n in
         plan.new_requests],
        list(plan.cached_requests),
        list(plan.num_scheduled_tokens.items()),
        plan.total_num_scheduled_tokens,
        sorted(plan.finished_request_ids),
        sorted(plan.preempted_request_ids),
    )


def make_requests(rng, count, shared):
    reqs = []
    for i in range(count):
        prompt = shared[:rng.randrange(len(shared) + 1)] + [rng.randrange(100, 500) for _ in range(rng.randrange(1, 12))]
        kind = rng.random()
        params = dict(max_tokens=rng.choice([None, rng.randrange(1, 20)]), ignore_eos=rng.random() < 0.3)
        if kind < 0.3:
            params["stop_token_ids"] = [STOP]
        if kind < 0.15 and params["max_tokens"] is not None:
            params["min_tokens"] = rng.randrange(0, params["max_tokens"] + 1)
        rid = f"r{i}" + ("lp" if rng.random() < 0.05 else "")
        reqs.append((rid, prompt, params))
    return reqs


def timeless(outputs):
    """Outputs with their queue time (a clock reading) reduced to whether they carry one."""
    import msgspec

    return [msgspec.structs.replace(o, queued_s=o.queued_s is not None) for o in outputs]


def run(fast: bool, seed: int, async_scheduling: bool, caching: bool, chunked: bool, propose: bool = False):
    rng = random.Random(seed)
    sched = Scheduler(max_num_seqs=6, max_num_batched_tokens=24 if chunked else 64, max_model_len=40, block_size=4,
                      num_blocks=22, enable_prefix_caching=caching, async_scheduling=async_scheduling,
                      enable_chunked_prefill=chunked)
    sched.fast_paths = fast
    runner = Runner(seed, propose)
    pending = make_requests(rng, 40, [rng.randrange(100, 500) for _ in range(10)])
    trace = []
    in_flight = None
    for _ in range(3000):
        if pending and rng.random() < 0.4:
            rid, prompt, params = pending.pop(0)
            sched.add_request(Request(rid, prompt, SamplingParams(**params), eos_token_id=EOS))
        if rng.random() < 0.03 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            trace.append(("abort", victim))
        if not pending and not sched.has_unfinished_requests() and in_flight is None:
            break
        plan = sched.schedule()
        trace.append(plan_key(plan))
        output = runner.execute(plan)
        if async_scheduling:
            if in_flight is not None:
                trace.append(timeless(sched.update_from_output(*in_flight)))
            in_flight = (plan, output) if plan.num_scheduled_tokens else None
            if in_flight is None:
                trace.append(timeless(sched.update_from_output(plan, ModelOutput())))
        else:
            trace.append(timeless(sched.update_from_output(plan, output)))
        if propose:
            trace.append(sorted((rid, list(r.spec_token_ids)) for rid, r in sched.requests.items()))
    assert not pending and not sched.has_unfinished_requests()
    return trace, sched


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_paths_give_the_general_paths_plans_and_outputs(seed, async_scheduling, caching, chunked):
    fast, fast_sched = run(True, seed, async_scheduling, caching, chunked)
    general, general_sched = run(False, seed, async_scheduling, caching, chunked)
    assert len(fast) == len(general)
    for i, (a, b) in enumerate(zip(fast, general)):
        assert a == b, f"step record {i} differs"
    assert fast_sched.stats() == general_sched.stats()
    assert fast_sched.num_preemptions > 0  # the pool is small enough that preemption is exercised
    assert fast_sched.num_needs_sync == fast_sched.num_needs_sync_sampling == 0  # every request was counted out


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_paths_apply_proposed_drafts_as_the_general_path(seed, async_scheduling):
    fast, _ = run(True, seed, async_scheduling, True, True, propose=True)
    general, _ = run(False, seed, async_scheduling, True, True, propose=True)
    assert len(fast) == len(general)
    for i, (a, b) in enumerate(zip(fast, general)):
        assert a == b, f"step record {i} differs"
    assert any(drafts for record in fast if isinstance(record, list) and record and isinstance(record[0], tuple)
               for _, drafts in record)


def test_needs_sync_counts_follow_added_and_finished_requests():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=32)
    sched.add_request(Request("plain", [1, 2, 3], SamplingParams(max_tokens=2)))
    sched.add_request(Request("seeded", [1, 2, 3], SamplingParams(max_tokens=2, seed=1)))
    assert (sched.num_needs_sync, sched.num_needs_sync_sampling) == (1, 1)
    sched.finish_requests("seeded", RequestStatus.FINISHED_ABORTED)
    assert (sched.num_needs_sync, sched.num_needs_sync_sampling) == (0, 0)
