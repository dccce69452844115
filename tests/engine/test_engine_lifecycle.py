"""An engine's lifetime in the user's process: `LLM.shutdown()`, `with LLM(...)` and `del llm` free the engine
(its core, worker, runner, model and scheduler are collected), its threads and its worker processes end, engines
built one after another in one process each give transformers' tokens, and a shut-down LLM says so when used.
The GPU side (device memory back, a second engine's KV pool) is tests/gpu/test_engine_lifecycle_gpu.py."""
from __future__ import annotations

import gc
import io
import threading
import weakref

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.structured_output import StructuredOutputsParams
from tests.engine.test_correctness import check_against_hf, random_prompts

PROMPTS = random_prompts([3, 17, 40, 9], seed=21)
MAX_TOKENS = [12, 6, 9, 15]


def _engine_refs(llm: LLM) -> dict[str, weakref.ref]:
    engine = llm.engine
    worker = engine.worker
    return {"engine core": weakref.ref(engine), "worker": weakref.ref(worker), "runner": weakref.ref(worker.runner),
            "model": weakref.ref(worker.model), "scheduler": weakref.ref(engine.scheduler)}


def _alive(refs: dict[str, weakref.ref]) -> list[str]:
    return [name for name, ref in refs.items() if ref() is not None]


def _start_tqdm_monitor() -> None:
    """tqdm starts one monitor thread per process with its first bar (weight loading shows one) and keeps it for
    every later bar: start it before a thread snapshot, so the snapshot holds only what the engine starts."""
    from tqdm.auto import tqdm

    tqdm(total=1, file=io.StringIO()).close()


def test_shutdown_frees_the_engine_and_ends_its_threads(tiny_llama_dir):
    _start_tqdm_monitor()
    before = set(threading.enumerate())
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64, async_scheduling=True)
    grammar = SamplingParams(temperature=0.0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(regex="[a-c]{2}-[0-9]{3}"))
    out = llm.generate(["Hello", "The quick"], [grammar, SamplingParams(temperature=0.0, max_tokens=4)],
                       use_tqdm=False)
    assert out[0].outputs[0].text and all(c in "abc-0123456789" for c in out[0].outputs[0].text)
    started = set(threading.enumerate()) - before
    assert any(t.name.startswith("pagedllm-grammar") for t in started), started  # the compile thread ran
    refs = _engine_refs(llm)

    llm.shutdown()
    # No gc.collect() here: shutdown() itself lets go of everything (the engine's cycles included).
    assert _alive(refs) == []
    assert set(threading.enumerate()) - before == set()
    llm.shutdown()  # idempotent


def test_del_frees_the_engine_at_once(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64)
    check_against_hf(llm, tiny_llama_dir, PROMPTS[:2], MAX_TOKENS[:2])
    refs = _engine_refs(llm)
    del llm
    assert _alive(refs) == []


def test_nothing_stays_frozen_in_the_users_process(tiny_llama_dir):
    """The steps run with the start-up objects frozen (short collections), but the user's process is left as it
    was: nothing frozen once the engine is built or generate() returns, so garbage cycles are collected."""
    assert gc.get_freeze_count() == 0
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64)
    assert gc.get_freeze_count() == 0
    llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert gc.get_freeze_count() == 0

    class Node:
        pass

    node = Node()
    node.self = node  # a cycle built before generate(): collectable after it
    ref = weakref.ref(node)
    llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    del node
    gc.collect()
    assert ref() is None
    llm.shutdown()


def test_engines_one_after_another_in_one_process_match_hf(tiny_model_dir):
    """A sweep: several engines in a row, each shut down (or deleted) before the next; each gives HF's tokens."""
    llama, qwen3 = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    first = LLM(model=llama, dtype="float32", num_gpu_blocks_override=64)
    check_against_hf(first, llama, PROMPTS, MAX_TOKENS)
    first_refs = _engine_refs(first)
    first.shutdown()
    assert _alive(first_refs) == []

    second = LLM(model=qwen3, dtype="float32", num_gpu_blocks_override=64)
    check_against_hf(second, qwen3, PROMPTS, MAX_TOKENS)
    second_refs = _engine_refs(second)
    del second
    assert _alive(second_refs) == []

    with LLM(model=llama, dtype="float32", num_gpu_blocks_override=64) as third:
        check_against_hf(third, llama, PROMPTS, MAX_TOKENS)
        third_refs = _engine_refs(third)
    assert _alive(third_refs) == []


def test_a_shut_down_llm_says_so(tiny_llama_dir):
    from pagedllm import BeamSearchParams

    with LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64) as llm:
        assert llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    calls = {
        "generate": lambda: llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False),
        "generate(token ids)": lambda: llm.generate({"prompt_token_ids": [5, 6]}, use_tqdm=False),
        "chat": lambda: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False),
        "beam_search": lambda: llm.beam_search(["Hello"], BeamSearchParams(beam_width=2, max_tokens=2)),
        "engine": lambda: llm.engine,
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="This LLM was shut down") as info:
            call()
        assert "create a new LLM" in str(info.value), name
    llm.shutdown()  # still a no-op


def test_engine_core_after_shutdown_refuses_requests(tiny_llama_dir):
    from pagedllm.core.engine_core import EngineCore, EngineCoreRequest, EngineShutDown

    core = EngineCore(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64)
    core.shutdown()
    assert core.worker is None and not core.has_unfinished_requests()
    with pytest.raises(EngineShutDown, match="shut down"):
        core.add_request(EngineCoreRequest("r", [5, 6, 7], SamplingParams(max_tokens=2)))
    with pytest.raises(EngineShutDown, match="shut down"):
        core.step()
    core.abort_requests(["r"])  # nothing to abort: no error
    core.shutdown()


def _live_models() -> weakref.WeakSet:
    from pagedllm.models.llama import LlamaForCausalLM

    return weakref.WeakSet(o for o in gc.get_objects() if type(o) is LlamaForCausalLM)


def test_a_failed_start_frees_what_it_loaded(tiny_llama_dir):
    """The model loads, then the KV budget is too small: the error (kept, as a notebook keeps the last one, with
    its traceback) must not hold the half-built engine's weights."""
    before = _live_models()
    with pytest.raises(ValueError, match="less than one sequence") as info:
        LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=4096)
    assert info.value.__traceback__ is not None
    left = set(_live_models()) - set(before)
    assert left == set()


@pytest.mark.timeout(240)
def test_worker_processes_exit_at_shutdown(tiny_llama_dir):
    """-tp 2 on the CPU: two worker processes (gloo), which end when the `with` block shuts the LLM down."""
    with LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64, tensor_parallel_size=2) as llm:
        procs = list(llm.engine.worker.procs.values())
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        check_against_hf(llm, tiny_llama_dir, PROMPTS[:2], MAX_TOKENS[:2])
        executor = weakref.ref(llm.engine.worker)
    # Ended and reaped (told to exit; one still running after a grace period is killed).
    assert all(p.poll() is not None for p in procs)
    assert executor() is None
