"""A fault inside a step that concerns one request (the sampled-token guard: a token id outside the vocabulary,
as non-finite logits give) fails that request only: EngineCore aborts it, preempts and recomputes the others
of the step, and the others' greedy tokens equal a run without the fault. Sync and async scheduling."""
from __future__ import annotations

import pytest

from pagedllm.core.engine_core import EngineCore, EngineCoreRequest
from pagedllm.core.errors import RequestStepError
from pagedllm.sampling_params import SamplingParams

PROMPTS = {"a": [5, 6, 7, 8], "b": [9, 10, 11], "c": [12, 13, 14, 15, 16]}


def _run(core: EngineCore) -> tuple[dict, list]:
    for rid, prompt in PROMPTS.items():
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        core.add_request(EngineCoreRequest(rid, list(prompt), params))
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    finished, failures = {}, []
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        try:
            outputs = core.step()
        except RequestStepError as e:
            failures.append(list(e.request_ids))
            for rid in e.request_ids:
                tokens.pop(rid, None)
            outputs = e.outputs  # what the step had already applied for the others
        for out in outputs:
            if out.request_id in tokens:
                tokens[out.request_id] += out.new_token_ids
                if out.finish_reason:
                    finished[out.request_id] = out.finish_reason
    return {rid: (toks, finished.get(rid)) for rid, toks in tokens.items()}, failures


def _poison(result, step: list[int], rid: str):
    step[0] += 1
    if step[0] == 4 and rid in result.req_ids:
        result.sampled_token_ids[result.req_ids.index(rid)] = [-1]
    return result


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_request_fault_fails_only_that_request(tiny_llama_dir: str, async_scheduling: bool) -> None:
    kwargs = dict(model=tiny_llama_dir, device="cpu", kv_cache_memory_bytes=16 << 20, async_scheduling=async_scheduling,
                  enable_prefix_caching=False)
    clean, failures = _run(EngineCore(**kwargs))
    assert not failures and all(reason == "length" and len(t) == 12 for t, reason in clean.values())

    core = EngineCore(**kwargs)
    step = [0]
    if async_scheduling:
        launch = core.worker.launch

        def faulty_launch(plan):
            pending = launch(plan)
            result = pending.result
            pending.result = lambda: _poison(result(), step, "b")
            return pending

        core.worker.launch = faulty_launch
    else:
        execute = core.worker.execute_model
        core.worker.execute_model = lambda plan: _poison(execute(plan), step, "b")
    faulty, failures = _run(core)
    assert failures == [["b"]]
    assert faulty == {"a": clean["a"], "c": clean["c"]}  # recomputed after the failed step: the same tokens
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv_cache_manager.get_usage() == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("sampling", ["greedy", "top_p"])
def test_constraints_leaving_no_token_fail_only_that_request(tiny_llama_dir: str, async_scheduling: bool,
                                                             sampling: str, caplog: pytest.LogCaptureFixture) -> None:
    """A request whose masks leave no token at some step (allowed_token_ids = its own stop token, with min_tokens
    not yet reached) is failed with a 400 saying so, at that step; the others go on with their own tokens (the
    sampler must neither crash on the all -inf row, as top-p did, nor emit a token the request forbids, as the
    argmax did)."""
    kwargs = dict(model=tiny_llama_dir, device="cpu", kv_cache_memory_bytes=16 << 20, async_scheduling=async_scheduling,
                  enable_prefix_caching=False)
    clean, failures = _run(EngineCore(**kwargs))
    assert not failures
    core = EngineCore(**kwargs)
    temperature = dict(temperature=0.0) if sampling == "greedy" else dict(temperature=0.8, top_p=0.9, seed=1)
    core.add_request(EngineCoreRequest("x", [5, 6, 7], SamplingParams(
        max_tokens=8, allowed_token_ids=[40], stop_token_ids=[40], min_tokens=3, **temperature)))
    errors: list[RequestStepError] = []
    run_step = core.step

    def step():
        try:
            return run_step()
        except RequestStepError as e:
            errors.append(e)
            raise

    core.step = step
    others, failures = _run(core)
    assert failures == [["x"]]
    assert errors[0].status == 400 and "no token satisfies" in errors[0].message
    # the client's doing: once logged at ERROR level, as an engine fault
    logged = [r for r in caplog.records if "no token satisfies" in r.getMessage()]
    assert logged and all(r.levelname == "WARNING" for r in logged), [(r.levelname, r.getMessage()) for r in logged]
    assert others == clean  # (x's failure preempted and recomputed the others: the same tokens)
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv_cache_manager.get_usage() == 0
