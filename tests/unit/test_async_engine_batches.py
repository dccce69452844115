"""What the API process's AsyncEngine hands a stream (entrypoints/async_engine.py), fed engine-core messages as
the engine core sends them: each engine step's output stays its own RequestOutput (outputs that arrived while
the consumer was busy come together as one batch, in order, never merged into one chunk); an error is raised
after the outputs before it; a consumer that leaves early aborts its request in the engine core."""
from __future__ import annotations

import asyncio
import shutil

import pytest

from pagedllm.config import EngineArgs
from pagedllm.core.batch_plan import EngineCoreOutput
from pagedllm.entrypoints import messages as m
from pagedllm.entrypoints.async_engine import AsyncEngine, EngineDeadError
from pagedllm.entrypoints.output_processor import OutputProcessor
from pagedllm.sampling_params import SamplingParams


class _InputChannel:
    """Stands in for the socket to the engine core: records the messages (the engine core would decode them)."""

    def __init__(self) -> None:
        self.sent: list = []
        self.decoder = m.input_decoder()

    def send(self, frame: bytes, *args, **kwargs):
        self.sent.append(self.decoder.decode(frame))
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def _engine() -> tuple[AsyncEngine, _InputChannel]:
    engine = AsyncEngine(EngineArgs(model="unused"))
    channel = _InputChannel()
    engine.in_socks = [channel]
    engine.processor = OutputProcessor(None)  # token ids only: no tokenizer needed
    return engine, channel


def _close(engine: AsyncEngine) -> None:
    """What shutdown() does without engine cores: close the sockets (a bare term() waits for them forever)."""
    engine.ctx.destroy(linger=0)
    shutil.rmtree(engine._tmpdir, ignore_errors=True)


_COLUMNS = [True]


@pytest.fixture(autouse=True, params=["columns", "structs"])
def _wire_form(request):
    """Every test twice: running steps as the engine core sends them (messages.step_outputs: columns), and each
    as its own EngineCoreOutput (the form every other output keeps)."""
    _COLUMNS[0] = request.param == "columns"
    yield


def _step(engine: AsyncEngine, request_id: str, token: int, finished: bool = False) -> None:
    """One engine step's message for one request, through the decoder, as it arrives from the engine core."""
    out = EngineCoreOutput(request_id, [token], finish_reason="length" if finished else None)
    msg = (m.step_outputs([out], m.SchedulerStatsMsg(), 0.0, 0) if _COLUMNS[0]
           else m.EngineOutputs(outputs=[out], stats=m.SchedulerStatsMsg()))
    assert bool(msg.step_ids) == (_COLUMNS[0] and not finished)
    engine._handle_output(engine.dec.decode(m.Encoder().encode(msg)))


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=8, detokenize=False)


def test_steps_that_arrive_together_stay_separate_chunks_in_order() -> None:
    async def run() -> list:
        engine, _ = _engine()
        gen = engine.generate_batches(None, [1, 2, 3], _params(), "r", "delta")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # the request is sent; nothing arrived yet
        _step(engine, "r", 11)
        batches = [await first]
        for token in (12, 13, 14):  # three steps while the consumer does not read
            _step(engine, "r", token)
        batches.append(await gen.__anext__())
        _step(engine, "r", 15, finished=True)
        batches.append(await gen.__anext__())
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        _close(engine)
        return batches

    batches = asyncio.run(run())
    assert [[ro.outputs[0].token_ids for ro in batch] for batch in batches] == [[[11]], [[12], [13], [14]], [[15]]]
    assert [[ro.finished for ro in batch] for batch in batches] == [[False], [False, False, False], [True]]


def test_an_error_comes_after_the_outputs_before_it() -> None:
    async def run() -> tuple[list, BaseException]:
        engine, _ = _engine()
        gen = engine.generate_batches(None, [1, 2, 3], _params(), "r", "delta")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        _step(engine, "r", 11)
        _step(engine, "r", 12)
        engine._handle_output(m.EngineDead(message="killed", engine_index=0))
        batch = await first
        with pytest.raises(EngineDeadError) as info:
            await gen.__anext__()
        _close(engine)
        return batch, info.value

    batch, error = asyncio.run(run())
    assert [ro.outputs[0].token_ids for ro in batch] == [[11], [12]]
    assert "killed" in str(error)


def test_generate_yields_each_step_and_leaving_early_aborts() -> None:
    async def run() -> tuple[list, list]:
        engine, channel = _engine()
        gen = engine.generate(None, [1, 2, 3], _params(), "r", "delta")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        _step(engine, "r", 11)
        _step(engine, "r", 12)
        got = [(await first).outputs[0].token_ids, (await gen.__anext__()).outputs[0].token_ids]
        await gen.aclose()  # the client went away before the request finished
        _close(engine)
        return got, channel.sent

    got, sent = asyncio.run(run())
    assert got == [[11], [12]]
    assert [type(msg).__name__ for msg in sent] == ["AddRequest", "AbortRequests"]
    assert sent[1].request_ids == ["r"]


def test_a_plain_stream_is_written_by_the_handler_only_while_its_writer_waits() -> None:
    """AsyncEngine.stream_directly: running steps go to the stream's frame + write while its consumer waits with
    nothing pending and the connection takes writes (one write per handler pass); otherwise, and for the
    finished output, they go the usual way. Whatever the path, the order is the engine's."""
    async def run() -> tuple[list, list]:
        engine, _ = _engine()
        gen = engine.generate_batches(None, [1, 2, 3], _params(), "r", "delta")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        _step(engine, "r", 11)
        log: list = []  # what reached the client, in order: ("direct", bytes) or ("writer", token ids)
        writable = [True]
        stop = engine.stream_directly("r", lambda text, n: b"<%d%s>" % (n, text.encode()),
                                      lambda: writable[0], lambda body: log.append(("direct", body)))
        assert stop is not None
        log.append(("writer", [ro.outputs[0].token_ids for ro in await first]))
        nxt = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # the writer waits: the next steps are the handler's to write
        _step(engine, "r", 12)
        _step(engine, "r", 13)
        assert log[1:] == []  # framed, not yet written: the pass goes on
        engine._flush_direct()
        writable[0] = False  # the client stopped reading: the writer takes the step and waits for the client
        _step(engine, "r", 14)
        engine._flush_direct()
        writable[0] = True
        _step(engine, "r", 15)  # the writer has not run yet (14 is pending): this one queues behind it
        engine._flush_direct()
        log.append(("writer", [ro.outputs[0].token_ids for ro in await nxt]))
        nxt = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        _step(engine, "r", 16)
        _step(engine, "r", 17, finished=True)  # the finished output is always the writer's (usage, [DONE])
        engine._flush_direct()
        log.append(("writer", [ro.outputs[0].token_ids for ro in await nxt]))
        stop()
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        _close(engine)
        return log

    log = asyncio.run(run())
    assert log == [("writer", [[11]]), ("direct", b"<1><1>"), ("writer", [[14], [15]]), ("direct", b"<1>"),
                   ("writer", [[17]])]


def test_only_a_running_plain_stream_goes_direct() -> None:
    async def run() -> list:
        engine, _ = _engine()
        got = []
        for rid, params in (("plain", _params()), ("n2", SamplingParams(max_tokens=8, n=2, detokenize=False)),
                            ("lp", SamplingParams(max_tokens=8, logprobs=1, detokenize=False))):
            gen = engine.generate_batches(None, [1, 2, 3], params, rid, "delta")
            task = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0)
            got.append(engine.stream_directly(rid, None, None, None) is not None)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        got.append(engine.stream_directly("gone", None, None, None) is not None)
        _close(engine)
        return got

    assert asyncio.run(run()) == [True, False, False, False]


def test_an_engine_process_exit_fails_pending_requests_and_sets_dead() -> None:
    """The watcher wakes on the process's sentinel (no polling): here a pipe whose writer closes, as a dead
    child's sentinel does."""
    import os
    from types import SimpleNamespace

    async def run() -> tuple[BaseException, bool, bool]:
        engine, _ = _engine()
        read_fd, write_fd = os.pipe()
        proc = SimpleNamespace(sentinel=read_fd, exitcode=None, is_alive=lambda: True, join=lambda timeout: None)
        engine.procs = [proc]
        watch = asyncio.ensure_future(engine._watch_engine())
        gen = engine.generate_batches(None, [1, 2, 3], _params(), "r", "delta")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        alive_before = not engine.dead.is_set()
        proc.exitcode = -9
        os.close(write_fd)
        with pytest.raises(EngineDeadError) as info:
            await asyncio.wait_for(first, 5)
        await asyncio.wait_for(watch, 5)
        os.close(read_fd)
        _close(engine)
        return info.value, alive_before, engine.dead.is_set()

    error, alive_before, dead = asyncio.run(run())
    assert alive_before and dead and "exit code -9" in str(error)


def test_columns_and_structs_give_the_same_outputs_n2_mixed() -> None:
    """A step whose outputs come partly as columns, partly as Structs (one child of an n=2 request finishing,
    the other running; a plain request running): the same RequestOutputs as the Structs alone (the children of
    one parent meet in one RequestOutput)."""
    def run(columns: bool) -> list:
        async def go() -> list:
            engine, _ = _engine()
            gens = {rid: engine.generate_batches(None, [1, 2, 3], params, rid, "delta")
                    for rid, params in (("p", _params()), ("n", SamplingParams(max_tokens=8, n=2,
                                                                                   detokenize=False)))}
            tasks = {rid: asyncio.ensure_future(g.__anext__()) for rid, g in gens.items()}
            await asyncio.sleep(0)
            steps = [[EngineCoreOutput("p", [5]), EngineCoreOutput("0_n", [6]), EngineCoreOutput("1_n", [7])],
                     [EngineCoreOutput("p", [8]), EngineCoreOutput("0_n", [9], finish_reason="length"),
                      EngineCoreOutput("1_n", [10])],
                     [EngineCoreOutput("p", [11], finish_reason="stop", stop_reason=2),
                      EngineCoreOutput("1_n", [12], finish_reason="length")]]
            for outs in steps:
                msg = (m.step_outputs(outs, None, 0.0, 0) if columns else m.EngineOutputs(outputs=outs))
                engine._handle_output(engine.dec.decode(m.Encoder().encode(msg)))
            got = []
            for rid, g in gens.items():
                batch = await tasks[rid]
                async for more in g:
                    batch += more
                got.append([(ro.request_id, ro.finished, [(c.index, c.token_ids, c.finish_reason, c.stop_reason)
                                                          for c in ro.outputs]) for ro in batch])
            _close(engine)
            return got
        return asyncio.run(go())

    assert run(True) == run(False)
    assert run(False)[1][0][2] == [(0, [6], None, None), (1, [7], None, None)]


def test_step_outputs_round_trip() -> None:
    from pagedllm.core.batch_plan import TokenLogprobs

    outs = [EngineCoreOutput("a", [1], num_cached_tokens=16), EngineCoreOutput("b", [2, 3]),
            EngineCoreOutput("c", [4], finish_reason="length"), EngineCoreOutput("d", [], num_cached_tokens=3),
            EngineCoreOutput("e", [5], new_logprobs=[TokenLogprobs([5], [-0.5], [1])]),
            EngineCoreOutput("f", [6], stop_reason=7), EngineCoreOutput("g", [8])]
    msg = m.output_decoder().decode(m.Encoder().encode(m.step_outputs(outs, m.SchedulerStatsMsg(), 1.5, 2)))
    assert msg.step_ids == ["a", "g"] and msg.step_tokens == [1, 8] and msg.step_cached == [16, 0]
    assert [o.request_id for o in msg.outputs] == ["b", "c", "d", "e", "f"]
    assert sorted(msg.all_outputs(), key=lambda o: o.request_id) == outs
    assert (msg.timestamp, msg.engine_index) == (1.5, 2)



def test_priority_travels_in_every_samples_add_request() -> None:
    """n > 1: each child AddRequest carries the request's priority (and cache salt), through the wire's decoder."""
    from pagedllm.entrypoints.async_engine import _Parent
    from pagedllm.entrypoints.parallel_sampling import fan_out

    engine, _ = _engine()
    try:
        children = fan_out("r", SamplingParams(max_tokens=8, detokenize=False, n=2))
        _, adds = engine._add_children("r", _Parent(), None, [1, 2, 3], children, "delta", None, "s", -3)
        decoded = [m.input_decoder().decode(m.Encoder().encode(a)) for a in adds]
    finally:
        _close(engine)
    assert [(a.request_id, a.priority, a.cache_salt) for a in decoded] == [("0_r", -3, "s"), ("1_r", -3, "s")]


def test_a_forgotten_requests_late_cleanup_spares_a_newer_request_with_its_id() -> None:
    """Request "dup" is forgotten (here the engine core refuses it; a client disconnect does the same) while its
    generator waits for its consumer; a new request takes the id, then the old generator ends. Its cleanup must
    leave the new one alone: it used to drop the new one's bookkeeping, so that one waited forever (its outputs
    had nowhere to go) and the next "dup" failed with a 500 (its output state left behind)."""
    from pagedllm.entrypoints.async_engine import RequestRejected

    async def run() -> list:
        engine, _ = _engine()
        try:
            old = engine.generate_batches(None, [1, 2, 3], _params(), "dup", "delta")
            first = asyncio.ensure_future(old.__anext__())
            await asyncio.sleep(0)
            _step(engine, "dup", 8)
            assert [o.outputs[0].token_ids for o in await first] == [[8]]  # old now waits for its consumer
            engine._handle_output(m.RequestError("dup", "Request id 'dup' is already in use.", 400))
            new = engine.generate_batches(None, [4, 5], _params(), "dup", "delta")
            new_next = asyncio.ensure_future(new.__anext__())
            await asyncio.sleep(0)  # the new request is registered
            with pytest.raises(RequestRejected, match="already in use"):
                await old.__anext__()
            _step(engine, "dup", 9, finished=True)
            batch = await asyncio.wait_for(new_next, 5)
            return [o.outputs[0].token_ids for o in batch]
        finally:
            _close(engine)

    assert asyncio.run(run()) == [[9]]


def test_a_request_the_output_processor_refuses_is_neither_sent_nor_counted() -> None:
    """The output processor refuses a request (here: stop strings without a tokenizer) while its samples are being
    registered: nothing goes to the engine core (no AddRequest, no needless AbortRequests), no bookkeeping is left
    behind, and `vllm:request_success` counts no abort for a request that never ran."""
    from prometheus_client import generate_latest

    from pagedllm.metrics import Metrics

    async def run() -> tuple[list, AsyncEngine]:
        engine, channel = _engine()
        engine.metrics = Metrics("m")
        try:
            with pytest.raises(ValueError, match="Stop strings need detokenization"):
                await engine.generate(None, [1, 2, 3], SamplingParams(max_tokens=8, n=2, stop=["x"]), "r",
                                      "delta").__anext__()
            ok = engine.generate(None, [1, 2], _params(), "r", "delta")  # the id is free again
            first = asyncio.ensure_future(ok.__anext__())
            await asyncio.sleep(0)
            _step(engine, "r", 7, finished=True)
            assert (await first).outputs[0].token_ids == [7]
            await ok.aclose()
        finally:
            _close(engine)
        return channel.sent, engine

    sent, engine = asyncio.run(run())
    assert [type(msg).__name__ for msg in sent] == ["AddRequest"] and sent[0].prompt_token_ids == [1, 2]
    assert not engine._timing and not engine._engine_to_parent and not engine._parents
    assert not engine.processor._requests and not engine.processor._parents
    text = generate_latest(engine.metrics.registry).decode()
    success = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{")}
    assert sum(v for labels, v in success.items() if 'finished_reason="abort"' in labels) == 0
    assert sum(success.values()) == 1  # the second request, finished
