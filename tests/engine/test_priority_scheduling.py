"""scheduling_policy="priority" end to end through LLM: requests of mixed priorities under a pool that forces
preemption still give transformers' exact greedy tokens (sync and async scheduling), the victims are always the
running request with the largest (priority, arrival), and fcfs refuses a non-zero priority."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler import Scheduler
from tests.engine.test_correctness import check_against_hf, random_prompts


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_priority_with_preemption_matches_hf(tiny_qwen3_dir, async_scheduling, monkeypatch):
    victims = []
    preempt = Scheduler._preempt

    def recording_preempt(self, request):  # the victim left `running` just before: it must outrank all still there
        victims.append((request.priority_key, [r.priority_key for r in self.running]))
        preempt(self, request)

    monkeypatch.setattr(Scheduler, "_preempt", recording_preempt)
    llm = LLM(model=tiny_qwen3_dir, dtype="float32", num_gpu_blocks_override=10, block_size=8, max_model_len=80,
              enable_prefix_caching=False, scheduling_policy="priority", async_scheduling=async_scheduling)
    prompts = random_prompts([12, 20, 7, 15, 9], seed=5)
    max_tokens = [24, 18, 30, 20, 16]
    priorities = [3, -1, 3, 0, 7]
    real_generate = llm.generate
    llm.generate = lambda ps, sp, use_tqdm: real_generate(ps, sp, use_tqdm=use_tqdm, priority=priorities)
    check_against_hf(llm, tiny_qwen3_dir, prompts, max_tokens)
    assert llm.engine.get_stats().num_preemptions > 0
    assert victims and all(all(key > other for other in running) for key, running in victims)
    assert not llm.engine.has_unfinished_requests()


def test_fcfs_refuses_a_priority(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=16, block_size=8, max_model_len=128)
    one = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=r"priority=2 needs priority scheduling: start the server with "
                                         r"--scheduling-policy priority"):
        llm.generate([[5, 6], [7, 8]], one, use_tqdm=False, priority=[0, 2])
    with pytest.raises(ValueError, match="one integer per prompt"):
        llm.generate([[5, 6], [7, 8]], one, use_tqdm=False, priority=[0])
    # Zeros are fcfs's own priority, and nothing was left queued by the refusal.
    outs = llm.generate([[5, 6], [7, 8]], one, use_tqdm=False, priority=[0, 0])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    assert not llm.engine.has_unfinished_requests()


def test_numpy_integer_priorities_are_integers(tiny_llama_dir):
    """A priority list built with numpy (np.int64 elements) was refused as "not an integer"; it runs as the same
    ints would. Bools and floats stay refused."""
    np = pytest.importorskip("numpy")
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=16, block_size=8, max_model_len=128,
              scheduling_policy="priority")
    greedy = SamplingParams(max_tokens=3, temperature=0)
    prompts = [[5, 6], [7, 8]]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False, priority=[2, -1])]
    outs = llm.generate(prompts, greedy, use_tqdm=False, priority=list(np.array([2, -1], dtype=np.int64)))
    assert [o.outputs[0].token_ids for o in outs] == want
    for bad in ([True, 0], [1.0, 0]):
        with pytest.raises(ValueError, match="priority must be an integer"):
            llm.generate(prompts, greedy, use_tqdm=False, priority=bad)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_urgent_late_arrival_preempts_a_less_urgent_running_request(tiny_llama_dir, async_scheduling):
    """Every seat held by less urgent requests (vLLM's issue 40004): an urgent request that arrives mid-run takes
    the least urgent one's seat in the next step; every request still gets transformers' exact greedy tokens."""
    from pagedllm.core.engine_core import EngineCoreRequest
    from tests.engine.test_correctness import hf_greedy

    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=32, block_size=8, max_model_len=96,
              max_num_seqs=2, scheduling_policy="priority", async_scheduling=async_scheduling)
    core = llm.engine
    prompts = dict(zip(["L1", "L2", "U"], random_prompts([9, 14, 6], seed=17)))
    lengths = {"L1": 24, "L2": 24, "U": 5}
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}

    def add(rid: str, priority: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=lengths[rid], ignore_eos=True)
        core.add_request(EngineCoreRequest(rid, prompts[rid], params, priority=priority))

    def run(steps=None) -> None:
        while core.has_unfinished_requests() and (steps is None or steps > 0):
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
            steps = None if steps is None else steps - 1

    add("L1", 5)
    add("L2", 5)
    run(4)
    preempted_before = core.get_stats().num_preemptions
    add("U", 0)
    run(3)
    assert len(tokens["U"]) >= 2  # running at once, not after a less urgent request finished
    assert core.get_stats().num_preemptions > preempted_before
    run()
    for rid, prompt in prompts.items():
        assert tokens[rid] == hf_greedy(tiny_llama_dir, prompt, lengths[rid])[0], rid


def test_victim_readmitted_in_the_same_step_keeps_its_tokens(tiny_llama_dir):
    """Async: an urgent arrival preempts a request whose token is in flight; its prefix block was a duplicate of
    another request's cached one, so it needs fewer blocks than it freed and the same plan readmits it. The in-flight
    token and the readmitted step's token for the same position were both appended (a repeated token)."""
    from pagedllm.core.engine_core import EngineCore, EngineCoreRequest

    def core(**kw):
        return EngineCore(model=tiny_llama_dir, dtype="float32", max_model_len=32, block_size=8, **kw)

    prefix = list(range(30, 38))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = core()
    plain.add_request(EngineCoreRequest("v", prefix, greedy))
    want: list[int] = []
    while plain.has_unfinished_requests():
        want += [t for o in plain.step() for t in o.new_token_ids]
    plain.shutdown()
    # One token per step: "v" computes the prefix block while "a" does, and holds the uncached duplicate.
    engine = core(num_gpu_blocks_override=4, scheduling_policy="priority", async_scheduling=True,
                  long_prefill_token_threshold=1)
    got: dict[str, list[int]] = {"a": [], "v": [], "u": []}

    def step() -> None:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids

    try:
        engine.add_request(EngineCoreRequest("a", prefix + [50], SamplingParams(temperature=0.0, max_tokens=12,
                                                                                ignore_eos=True)))
        step()
        engine.add_request(EngineCoreRequest("v", prefix, greedy, priority=1))
        sched = engine.scheduler
        for _ in range(40):  # until "v" has one token and the next in flight, and the pool is full
            v = sched.requests["v"]
            if v.num_output_tokens == 1 and v.num_output_placeholders and sched.kv_cache_manager.num_free_blocks == 0:
                break
            step()
        else:
            pytest.fail("the pool never filled up")
        engine.add_request(EngineCoreRequest("u", [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=2,
                                                                           ignore_eos=True)))
        while engine.has_unfinished_requests():
            step()
        assert sched.num_preemptions == 1
        assert got["v"] == want
        assert sched.kv_cache_manager.num_free_blocks == 4
    finally:
        engine.shutdown()
