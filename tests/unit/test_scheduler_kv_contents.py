"""The scheduler against a runner that keeps the KV cache's contents: every slot it writes holds the tokens up to
that position, and every row checks all of its KV (through its block table, after the plan's block copies) before
it samples a token that is a function of the row's tokens. Block tables, prefix hits, partial-block copies,
preemption, aborts, chunking, priorities and async scheduling must together give each request exactly the tokens of
an undisturbed run, its finish by length, and a free pool at the end."""
from __future__ import annotations

import random

import pytest

from pagedllm.core.batch_plan import ModelOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

BS = 4


def next_token(tokens) -> int:
    return 100 + random.Random(repr(tokens)).randrange(400)


class KVRunner:
    """Per-request state from the plans' diffs only, as the model runner keeps it, and the pool's slots."""

    def __init__(self, num_blocks: int):
        self.kv = [[None] * BS for _ in range(num_blocks)]
        self.state: dict[str, dict] = {}

    def execute(self, plan) -> ModelOutput:
        for src, dst in plan.kv_block_copies:  # before the forward, as the runner does
            self.kv[dst] = list(self.kv[src])
        for rid in plan.finished_request_ids:
            self.state.pop(rid, None)
        for new in plan.new_requests:
            assert new.request_id not in self.state
            self.state[new.request_id] = dict(tokens=list(new.token_ids), blocks=list(new.block_ids),
                                              computed=new.num_computed_tokens)
        for cached in plan.cached_requests:
            s = self.state[cached.request_id]
            assert s["computed"] == cached.num_computed_tokens
            s["blocks"] += cached.new_block_ids
        for rid, n in plan.num_scheduled_tokens.items():  # every row's K/V is written before any is read
            s = self.state[rid]
            for p in range(s["computed"], s["computed"] + n):
                self.kv[s["blocks"][p // BS]][p % BS] = tuple(s["tokens"][:p + 1])
        out = ModelOutput()
        for rid, n in plan.num_scheduled_tokens.items():
            s = self.state[rid]
            s["computed"] += n
            for p in range(s["computed"]):
                assert self.kv[s["blocks"][p // BS]][p % BS] == tuple(s["tokens"][:p + 1]), f"{rid}: KV at {p}"
            sampled = []
            if s["computed"] == len(s["tokens"]):
                sampled = [next_token(s["tokens"])]
                s["tokens"] += sampled
            out.req_ids.append(rid)
            out.sampled_token_ids.append(sampled)
            out.logprobs.append(None)
        return out


def run(seed: int, num_blocks: int, **kw) -> None:
    rng = random.Random(seed)
    args = dict(max_num_seqs=6, max_num_batched_tokens=16, max_model_len=40, block_size=BS, num_blocks=num_blocks)
    args.update(kw)
    sched = Scheduler(**args)
    runner = KVRunner(num_blocks)
    shared = [rng.randrange(100, 500) for _ in range(12)]
    pending: list[Request] = []
    for i in range(25):
        k = rng.random()
        if k < 0.5:  # a shared prefix, often cut inside a block (partial-block copies)
            prompt = shared[:rng.randrange(13)] + [rng.randrange(100, 500) for _ in range(rng.randrange(6))]
        elif k < 0.7 and pending:  # an exact repeat
            prompt = list(rng.choice(pending).prompt_token_ids)
        else:
            prompt = [rng.randrange(100, 500) for _ in range(rng.randrange(1, 20))]
        prio = rng.randint(-1, 1) if kw.get("scheduling_policy") == "priority" else 0
        pending.append(Request(f"r{i}", prompt or [5], SamplingParams(max_tokens=rng.randrange(1, 12),
                                                                      ignore_eos=True), priority=prio))
    reqs = list(pending)
    in_flight = None
    for _ in range(3000):
        if pending and rng.random() < 0.4:
            sched.add_request(pending.pop(0))
        if rng.random() < 0.03 and sched.requests:
            sched.finish_requests(rng.choice(sorted(sched.requests)), RequestStatus.FINISHED_ABORTED)
        if not pending and not sched.has_unfinished_requests() and in_flight is None:
            break
        plan = sched.schedule()
        output = runner.execute(plan)
        if kw.get("async_scheduling"):  # the step's results land after the next schedule()
            if in_flight is not None:
                sched.update_from_output(*in_flight)
            in_flight = (plan, output) if plan.num_scheduled_tokens else None
            if in_flight is None:
                sched.update_from_output(plan, ModelOutput())
        else:
            sched.update_from_output(plan, output)
    assert not pending and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == num_blocks
    for r in reqs:
        if r.status == RequestStatus.FINISHED_ABORTED:
            continue
        tokens = list(r.prompt_token_ids)
        for t in r.output_token_ids:
            assert t == next_token(tokens), r.request_id
            tokens.append(t)
        assert (r.status, r.num_output_tokens) == (RequestStatus.FINISHED_LENGTH, r.sampling_params.max_tokens)


CONFIGS = [
    dict(num_blocks=16),
    dict(num_blocks=10, async_scheduling=True),
    dict(num_blocks=11, enable_chunked_prefill=False, max_num_batched_tokens=40),
    dict(num_blocks=10, max_num_batched_tokens=3, max_num_seqs=3, async_scheduling=True),
    dict(num_blocks=11, long_prefill_token_threshold=2),
    dict(num_blocks=11, scheduling_policy="priority"),
    dict(num_blocks=11, scheduling_policy="priority", async_scheduling=True),
]


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_contents_and_tokens_under_any_scheduling(seed, kw):
    run(seed, **kw)


@pytest.mark.parametrize("seed", [15, 50, 57])
def test_victim_readmitted_in_the_step_that_preempted_it(seed):
    """Priority + async: an urgent arrival preempts a running request whose token is in flight, and the room left
    readmits the victim in the same plan (its prefix is a hit on another request's block, so it needs fewer blocks
    than it freed). The in-flight row was applied to the readmitted request as its next token, and the readmitted
    plan's row (the same position) then again: a repeated token."""
    run(seed, num_blocks=11, scheduling_policy="priority", async_scheduling=True)
