"""--scheduling-policy priority in the scheduler: admission in (priority, arrival) order, the running request with
the largest (priority, arrival) preempted first (vLLM's rule), ties by arrival, resumed requests back in their
place; fcfs unchanged (the same plans whatever the priorities say, since the engine refuses them there)."""
import pytest

from pagedllm.core.request import Request, RequestStatus, check_priority
from tests.unit.test_scheduler import FakeRunner, make_req, make_sched, run_to_completion, step


def req(rid, tokens, priority=0, arrival=None, max_tokens=16):
    r = make_req(rid, tokens, max_tokens=max_tokens)
    r.priority = priority
    if arrival is not None:
        r.arrival_time = arrival
    return r


def test_admission_in_priority_then_arrival_order():
    sched = make_sched(scheduling_policy="priority", max_num_seqs=1)
    runner = FakeRunner()
    for rid, prio, t in (("A", 5, 1.0), ("B", 1, 2.0), ("C", 1, 1.5), ("D", -3, 9.0), ("E", 1, 1.5)):
        sched.add_request(req(rid, 4, prio, t, max_tokens=1))
    # D (-3); then priority 1 by arrival: C (1.5), E (1.5, added after C), B (2.0); then A (5)
    assert [r.request_id for r in sched.waiting] == ["D", "C", "E", "B", "A"]
    order = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched, runner)
        order += [n.request_id for n in plan.new_requests]
    assert order == ["D", "C", "E", "B", "A"]


def test_fcfs_ignores_priority_and_keeps_order():
    sched = make_sched(max_num_seqs=1)
    runner = FakeRunner()
    for rid, prio in (("A", 5), ("B", 1), ("C", -1)):
        sched.add_request(req(rid, 4, prio, max_tokens=1))
    order = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched, runner)
        order += [n.request_id for n in plan.new_requests]
    assert order == ["A", "B", "C"] and not sched.priority


def test_preempts_the_largest_priority_not_the_newest():
    # Three one-block requests fill the pool (only B's block is full); the one with the largest priority value is
    # the victim, though it came first (fcfs would take C, the newest), and it resumes in its (priority, arrival) place.
    sched = make_sched(scheduling_policy="priority", num_blocks=3, enable_prefix_caching=False)
    runner = FakeRunner()
    a, b, c = req("A", 3, 9, 1.0, max_tokens=5), req("B", 4, 0, 2.0, max_tokens=5), req("C", 3, 0, 3.0, max_tokens=5)
    for r in (a, b, c):
        sched.add_request(r)
    plan, _ = step(sched, runner)
    assert [n.request_id for n in plan.new_requests] == ["B", "C", "A"]  # admitted by priority
    assert [r.request_id for r in sched.running] == ["B", "C", "A"]
    plan, _ = step(sched, runner)  # B needs a 2nd block: A (priority 9) goes, C (newest) stays
    assert plan.preempted_request_ids == {"A"} and a.status == RequestStatus.PREEMPTED
    assert plan.num_scheduled_tokens == {"B": 1, "C": 1}
    assert list(sched.waiting) == [a]
    outs = run_to_completion(sched, runner)
    assert b.output_token_ids == [1004, 1005, 1006, 1007, 1008]
    assert a.output_token_ids == c.output_token_ids == [1003, 1004, 1005, 1006, 1007]
    assert set(outs) == {"A", "B", "C"} and a.num_preemptions >= 1 and b.num_preemptions == 0


def test_ties_preempt_the_latest_arrival():
    sched = make_sched(scheduling_policy="priority", num_blocks=3, enable_prefix_caching=False)
    runner = FakeRunner()
    reqs = [req("A", 4, 1, 3.0, 5), req("B", 4, 1, 1.0, 5), req("C", 4, 1, 2.0, 5)]
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)
    plan, _ = step(sched, runner)
    # B runs first (earliest); A (latest arrival) is preempted for it, then C needs a block and is itself the
    # largest left: preempted too.
    assert plan.num_scheduled_tokens == {"B": 1} and plan.preempted_request_ids == {"A", "C"}
    assert [r.request_id for r in sched.waiting] == ["C", "A"]  # back in (priority, arrival) order
    run_to_completion(sched, runner)
    assert all(r.output_token_ids == [1004, 1005, 1006, 1007, 1008] for r in reqs)


def test_urgent_request_arriving_later_goes_before_a_resumed_one():
    sched = make_sched(scheduling_policy="priority", num_blocks=3, enable_prefix_caching=False)
    runner = FakeRunner()
    a, b = req("A", 4, 0, 1.0, 8), req("B", 8, 5, 2.0, 4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    plan, _ = step(sched, runner)  # A needs a 2nd block: B (priority 5) preempted
    assert plan.preempted_request_ids == {"B"}
    u = req("U", 4, 2, 3.0, 1)
    sched.add_request(u)
    assert list(sched.waiting) == [u, b]  # fcfs would have put the resumed B at the front
    run_to_completion(sched, runner)
    assert b.output_token_ids == [1008, 1009, 1010, 1011]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_priority_preemption_with_async_scheduling_and_general_path(async_scheduling):
    # The same outputs with the fast paths off and with a step in flight (placeholders of a victim dropped).
    results = []
    for fast in (True, False):
        sched = make_sched(scheduling_policy="priority", num_blocks=6, enable_prefix_caching=False,
                           async_scheduling=async_scheduling)
        sched.fast_paths = fast
        runner = FakeRunner()
        reqs = [req(f"R{i}", 3 + i, priority=(7 * i) % 4, arrival=float(i), max_tokens=6) for i in range(5)]
        for r in reqs:
            sched.add_request(r)
        run_to_completion(sched, runner)
        results.append([r.output_token_ids for r in reqs])
        assert sched.stats().num_preemptions > 0
        assert all(len(o) == 6 for o in results[-1])
    assert results[0] == results[1]


def test_check_priority():
    check_priority(0, "fcfs")
    check_priority(-4, "priority")
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        check_priority(1, "fcfs")
    for bad in (True, 1.5, "1"):
        with pytest.raises(ValueError, match="priority must be an integer"):
            check_priority(bad, "priority")
    with pytest.raises(ValueError, match=r"priority must be in \[-2\*\*63, 2\*\*63\), got 9223372036854775808\."):
        check_priority(2 ** 63, "priority")
    with pytest.raises(ValueError, match="scheduling_policy must be fcfs or priority"):
        make_sched(scheduling_policy="lifo")


def test_request_defaults_to_priority_zero():
    assert Request("x", [1], make_req("y", 1).sampling_params).priority == 0


def test_an_urgent_arrival_takes_a_seat_from_a_less_urgent_request():
    """max_num_seqs full of less urgent requests (vLLM issue 40004): the least urgent is preempted in the step
    after the urgent one arrives, and the urgent one runs in that same step."""
    sched = make_sched(scheduling_policy="priority", max_num_seqs=2)
    runner = FakeRunner()
    low1, low2 = req("L1", 4, 5, 1.0, max_tokens=12), req("L2", 4, 5, 2.0, max_tokens=12)
    for r in (low1, low2):
        sched.add_request(r)
    step(sched, runner)
    step(sched, runner)
    urgent = req("U", 4, 0, 3.0, max_tokens=3)
    sched.add_request(urgent)
    plan, _ = step(sched, runner)
    assert plan.preempted_request_ids == {"L2"} and [n.request_id for n in plan.new_requests] == ["U"]
    assert [r.request_id for r in sched.running] == ["U", "L1"] and list(sched.waiting) == [low2]
    run_to_completion(sched, runner)
    assert urgent.output_token_ids == [1004, 1005, 1006]
    assert low1.output_token_ids == low2.output_token_ids == list(range(1004, 1016))  # the victim recomputed


def test_equal_or_lower_priority_arrivals_wait():
    for prio in (5, 9):
        sched = make_sched(scheduling_policy="priority", max_num_seqs=1)
        runner = FakeRunner()
        sched.add_request(req("L", 4, 5, 1.0, max_tokens=6))
        step(sched, runner)
        sched.add_request(req("N", 4, prio, 2.0, max_tokens=2))
        plan, _ = step(sched, runner)
        assert not plan.preempted_request_ids and not plan.new_requests


def test_an_urgent_arrival_takes_blocks_from_less_urgent_requests():
    # The pool (6 blocks) is held by two less urgent requests; the urgent one needs 3 blocks for its prompt: the
    # least urgent is preempted, which frees enough; the other is not (none is preempted for more than needed).
    sched = make_sched(scheduling_policy="priority", num_blocks=6, enable_prefix_caching=False)
    runner = FakeRunner()
    a, b = req("A", 9, 3, 1.0, max_tokens=10), req("B", 9, 4, 2.0, max_tokens=10)
    for r in (a, b):
        sched.add_request(r)
    step(sched, runner)
    assert sched.kv_cache_manager.num_free_blocks == 0
    u = req("U", 12, 1, 3.0, max_tokens=2)
    sched.add_request(u)
    plan, _ = step(sched, runner)
    assert plan.preempted_request_ids == {"B"} and [n.request_id for n in plan.new_requests] == ["U"]
    run_to_completion(sched, runner)
    assert u.output_token_ids == [1012, 1013]
    assert a.output_token_ids == b.output_token_ids == list(range(1009, 1019))


def test_adapters_count_in_what_an_urgent_arrival_needs():
    """max_loras: an urgent request whose adapter is one too many preempts the less urgent holder of another
    adapter; but when the more urgent running requests' adapters alone leave no slot, nothing is preempted."""
    def lora_req(rid, prio, arrival, lora):
        r = req(rid, 4, prio, arrival, max_tokens=6)
        r.lora_id = lora
        return r

    sched = make_sched(scheduling_policy="priority", max_loras=2)
    runner = FakeRunner()
    for r in (lora_req("H", 0, 1.0, 1), lora_req("L", 7, 2.0, 2)):
        sched.add_request(r)
    step(sched, runner)
    sched.add_request(lora_req("U", 3, 3.0, 3))
    plan, _ = step(sched, runner)
    assert plan.preempted_request_ids == {"L"} and [n.request_id for n in plan.new_requests] == ["U"]
    run_to_completion(sched, runner)

    sched = make_sched(scheduling_policy="priority", max_loras=1)
    runner = FakeRunner()
    for r in (lora_req("H", 0, 1.0, 1), lora_req("L", 7, 2.0, 1)):
        sched.add_request(r)
    step(sched, runner)
    sched.add_request(lora_req("U", 3, 3.0, 2))  # H's adapter alone takes the one slot: U waits for H
    plan, _ = step(sched, runner)
    assert not plan.preempted_request_ids and not plan.new_requests
    assert [r.request_id for r in sched.running] == ["H", "L"]
    run_to_completion(sched, runner)


def test_an_urgent_arrival_counts_its_hits_that_a_victim_frees():
    """The urgent request's prefix hits are blocks only the least urgent request holds: preempting it makes them
    free blocks that taking them back uses up, so it is not room enough by itself. Both less urgent requests are
    preempted in the same step and the urgent one is admitted at once (it was left waiting a step while the other
    ran on, and was preempted only then)."""
    sched = make_sched(scheduling_policy="priority", num_blocks=4)
    runner = FakeRunner()
    prefix = list(range(500, 508))  # two full blocks
    x, v = req("X", 3, 5, 1.0, max_tokens=10), req("V", prefix, 5, 2.0, max_tokens=8)
    for r in (x, v):
        sched.add_request(r)
    step(sched, runner)
    step(sched, runner)  # V holds its two prefix blocks and a third for its first token
    assert sched.kv_cache_manager.num_free_blocks == 0
    u = req("U", prefix + list(range(600, 605)), 1, 3.0, max_tokens=2)  # 2 hits + 2 fresh blocks
    sched.add_request(u)
    plan, _ = step(sched, runner)
    assert plan.preempted_request_ids == {"V", "X"} and [n.request_id for n in plan.new_requests] == ["U"]
    assert plan.new_requests[0].num_computed_tokens == 8
    run_to_completion(sched, runner)
    assert u.output_token_ids == [1013, 1014]
    assert x.output_token_ids == list(range(1003, 1013)) and v.output_token_ids == list(range(1008, 1016))
    assert sched.kv_cache_manager.num_free_blocks == 4
