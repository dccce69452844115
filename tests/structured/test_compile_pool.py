"""Grammar compiles on the manager's pool: a slow compile does not hold a fast one, and a request that goes away
before its compile starts never starts it. A fake backend stands in for the library (compiles wait on events):
the assertions are about order and completion, never about wall-clock time."""
from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pagedllm.structured_output.backend import GrammarBackend, RequestGrammar  # noqa: E402
from pagedllm.structured_output.manager import StructuredOutputManager  # noqa: E402
from pagedllm.structured_output.params import StructuredOutputsParams  # noqa: E402

_HANG_GUARD_S = 60  # only so a broken build fails instead of hanging; never reached when the code works


class _Grammar(RequestGrammar):
    def accept_tokens(self, token_ids: Any) -> bool:
        return True

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        bitmask[row] = -1

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        pass


class _GatedBackend(GrammarBackend):
    """compile(regex) waits for gates[regex] (if any) and records which compiles started / finished."""

    name = "xgrammar"

    def __init__(self, vocab_size: int = 64) -> None:
        super().__init__(None, vocab_size, [0])
        self.gates: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}
        self.finished: list[str] = []

    def gate(self, regex: str) -> threading.Event:
        self.started[regex] = threading.Event()
        self.gates[regex] = threading.Event()
        return self.gates[regex]

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        pass

    def compile(self, params: StructuredOutputsParams) -> Any:
        regex = params.regex
        if regex in self.started:
            self.started[regex].set()
        if regex in self.gates:
            assert self.gates[regex].wait(_HANG_GUARD_S)
        self.finished.append(regex)
        return regex

    def new_grammar(self, compiled: Any) -> RequestGrammar:
        return _Grammar()

    def fill_bitmasks(self, grammars: list, bitmask: Any) -> None:
        for i, g in enumerate(grammars):
            g.fill_bitmask(bitmask, i)


@pytest.fixture()
def manager():
    m = StructuredOutputManager("unused", 64, [0], config={"backend": "xgrammar"})
    fake = _GatedBackend()
    m._backends["xgrammar"] = fake
    m.fake = fake
    yield m
    for gate in fake.gates.values():
        gate.set()
    m.shutdown()


def _regex(text: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=text)


def test_pool_has_several_workers_bounded_by_the_cpus(manager, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.structured_output import manager as module

    monkeypatch.setattr(module.os, "cpu_count", lambda: 64)
    assert module.compile_workers() == 4
    monkeypatch.setattr(module.os, "cpu_count", lambda: 1)
    assert module.compile_workers() == 1


def test_slow_compile_does_not_hold_a_fast_one(manager) -> None:
    """Once one worker: every structured request waited behind a 20,000-alternative regex's compile."""
    if manager.max_workers < 2:
        manager.max_workers = 2  # a one-CPU machine: the pool still has room for a second compile
    fake = manager.fake
    release_slow = fake.gate("slow")
    slow = manager.submit(_regex("slow"))
    assert fake.started["slow"].wait(_HANG_GUARD_S)
    fast = manager.submit(_regex("fast"))
    fast.future.result(timeout=_HANG_GUARD_S)
    assert fast.is_ready() and not slow.future.done() and fake.finished == ["fast"]
    release_slow.set()
    slow.future.result(timeout=_HANG_GUARD_S)
    assert slow.is_ready() and fake.finished == ["fast", "slow"]


def test_released_request_queued_compile_never_starts(manager) -> None:
    fake = manager.fake
    blockers = [f"busy{i}" for i in range(manager.max_workers)]
    gates = [fake.gate(b) for b in blockers]
    busy = [manager.submit(_regex(b)) for b in blockers]
    for b in blockers:  # every worker is taken: the next compile is queued
        assert fake.started[b].wait(_HANG_GUARD_S)
    fake.started["gone"] = threading.Event()
    gone = manager.submit(_regex("gone"))
    shared_a, shared_b = manager.submit(_regex("shared")), manager.submit(_regex("shared"))
    manager.release(gone)
    manager.release(shared_a)  # shared_b still waits for the same compile: it must run
    for gate in gates:
        gate.set()
    for so in busy + [shared_b]:
        so.future.result(timeout=_HANG_GUARD_S)
    manager.shutdown()  # waits for every started compile
    assert gone.future.cancelled() and not fake.started["gone"].is_set() and "gone" not in fake.finished
    assert not gone.is_ready() and gone.error is None
    assert shared_b.is_ready() and "shared" in fake.finished


def test_released_running_compile_result_is_not_cached(manager) -> None:
    fake = manager.fake
    gate = fake.gate("running")
    first = manager.submit(_regex("running"))
    assert fake.started["running"].wait(_HANG_GUARD_S)
    manager.release(first)  # running: it cannot be stopped, but nobody keeps its result
    gate.set()
    first.future.result(timeout=_HANG_GUARD_S)
    again = manager.submit(_regex("running"))
    assert again.future is not first.future
    again.future.result(timeout=_HANG_GUARD_S)
    assert fake.finished == ["running", "running"]


def test_engine_abort_releases_the_compile(manager) -> None:
    """EngineCore.abort_requests -> StructuredOutputHooks.release -> the manager drops the queued compile."""
    from types import SimpleNamespace

    from pagedllm.core.structured_hooks import StructuredOutputHooks

    hooks = StructuredOutputHooks(SimpleNamespace(), SimpleNamespace(structured_outputs_config=None))
    hooks.manager = manager
    fake = manager.fake
    blockers = [f"b{i}" for i in range(manager.max_workers)]
    gates = [fake.gate(b) for b in blockers]
    for b in blockers:
        manager.submit(_regex(b))
        assert fake.started[b].wait(_HANG_GUARD_S)
    so = manager.submit(_regex("aborted"))
    hooks._compiling["r1"] = SimpleNamespace(structured_output=so)
    hooks.release(["r1", "unknown"])
    assert "r1" not in hooks._compiling and so.future.cancelled()
    for gate in gates:
        gate.set()
    manager.shutdown()
    assert "aborted" not in fake.finished


def test_engine_abort_of_a_queued_compile_never_starts_it(tiny_llama_dir: str) -> None:
    """Through the real EngineCore: a request aborted while its compile waits for a worker never compiles; the
    requests whose compiles ran finish normally."""
    from pagedllm.core.engine_core import EngineCore, EngineCoreRequest
    from pagedllm.sampling_params import SamplingParams

    core = EngineCore(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64)
    try:
        manager = core.structured._get_manager()
        fake = _GatedBackend(core.vocab_size)
        manager._backends["xgrammar"] = fake

        def add(rid: str, regex: str) -> None:
            params = SamplingParams(max_tokens=2, temperature=0, structured_outputs=_regex(regex))
            core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=[5, 9, 33], sampling_params=params))

        blockers = [f"busy{i}" for i in range(manager.max_workers)]
        gates = [fake.gate(b) for b in blockers]
        for b in blockers:
            add(b, b)
            assert fake.started[b].wait(_HANG_GUARD_S)
        fake.started["victim"] = threading.Event()
        add("victim", "victim")
        core.abort_requests(["victim"])
        for gate in gates:
            gate.set()
        # The pool's queue is FIFO: once a compile queued after the victim's is done, the victim's left the queue
        # (run or skipped); shutdown() then waits for any compile still running. No engine step ran meanwhile.
        manager.submit(_regex("after")).future.result(timeout=_HANG_GUARD_S)
        manager.shutdown()
        assert not fake.started["victim"].is_set() and "victim" not in fake.finished
        finished = set()
        for _ in range(200):
            finished |= {o.request_id for o in core.step() if o.finish_reason is not None}
            if finished >= set(blockers):
                break
        assert finished >= set(blockers)
    finally:
        core.shutdown()
