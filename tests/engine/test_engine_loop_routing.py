"""The engine core's loop with two API server processes (`--api-server-count 2`): a real EngineCore (the tiny
Llama on the CPU) and its real EngineLoop, over in-process ZMQ sockets in place of the ipc:// ones. Each process
gets its own requests' outputs and replies only; a request id one process runs cannot be taken or aborted by the
other; a process that is gone (ClientGone) has its requests aborted and is sent nothing more."""
from __future__ import annotations

import threading

import pytest

from pagedllm.sampling_params import SamplingParams

zmq = pytest.importorskip("zmq")


class Wires:
    """Two clients' input and output channels, and the engine loop between them, run in a thread."""

    def __init__(self, core) -> None:
        from pagedllm.entrypoints import messages as m
        from pagedllm.entrypoints.engine_proc import EngineLoop

        self.m = m
        self.ctx = zmq.Context()
        self.enc, self.dec = m.Encoder(), m.output_decoder()
        self.ins, self.outs, engine_outs = [], [], []
        engine_in = self.ctx.socket(zmq.PULL)
        for c in range(2):
            push = self.ctx.socket(zmq.PUSH)
            push.bind(f"inproc://in-{c}")
            engine_in.connect(f"inproc://in-{c}")
            pull = self.ctx.socket(zmq.PULL)
            pull.bind(f"inproc://out-{c}")
            out = self.ctx.socket(zmq.PUSH)
            out.connect(f"inproc://out-{c}")
            self.ins.append(push)
            self.outs.append(pull)
            engine_outs.append(out)
        self._engine_socks = [engine_in, *engine_outs]
        self.loop = EngineLoop(core, engine_in, engine_outs[0], 0, out_socks=engine_outs)
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def send(self, client: int, msg) -> None:
        self.ins[client].send(self.enc.encode(msg))

    def recv(self, client: int):
        assert self.outs[client].poll(60_000), "nothing came"  # a hang guard
        return self.dec.decode(self.outs[client].recv())

    def pending(self, client: int) -> bool:
        return bool(self.outs[client].poll(0))

    def add(self, client: int, rid: str, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.send(client, self.m.AddRequest(rid, [5, 9, 33, 7], params, client_index=client))

    def until_finished(self, client: int, rids: set) -> tuple[dict, list]:
        """Read client's channel until every id in rids finished: (tokens per id, other messages)."""
        tokens: dict = {}
        others = []
        left = set(rids)
        while left:
            msg = self.recv(client)
            if isinstance(msg, self.m.EngineOutputs):
                for out in msg.all_outputs():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.finish_reason is not None:
                        left.discard(out.request_id)
            else:
                others.append(msg)
                if isinstance(msg, self.m.RequestError):
                    left.discard(msg.request_id)
        return tokens, others

    def stats(self, client: int):
        self.send(client, self.m.GetStats(seq=7, client_index=client))
        while True:
            msg = self.recv(client)
            if isinstance(msg, self.m.StatsReply):
                return msg.stats

    def close(self) -> None:
        self.send(0, self.m.Shutdown())
        self.thread.join(60)
        for sock in self.ins + self.outs + self._engine_socks:
            sock.close(0)
        self.ctx.term()


@pytest.fixture()
def wires(tiny_llama_dir):
    from pagedllm.core.engine_core import EngineCore

    core = EngineCore(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64)
    w = Wires(core)
    try:
        yield w
    finally:
        w.close()
        core.shutdown()


def test_outputs_and_replies_go_to_the_process_that_sent_the_request(wires: Wires) -> None:
    m = wires.m
    wires.add(0, "a", 6)
    wires.add(1, "b", 4)
    wires.add(1, "a", 3)  # process 1 reuses an id process 0 runs: refused, for process 1 only
    wires.send(1, m.AbortRequests(["a"], client_index=1))  # not process 1's "a" to abort
    got0, others0 = wires.until_finished(0, {"a"})
    got1, others1 = wires.until_finished(1, {"a", "b"})
    assert set(got0) == {"a"} and len(got0["a"]) == 6 and not others0
    assert set(got1) == {"b"} and len(got1["b"]) == 4
    (error,) = others1
    assert isinstance(error, m.RequestError) and error.request_id == "a" and "already in use" in error.message
    assert wires.stats(0).num_aborted == 0


def test_a_gone_process_has_its_requests_aborted_and_gets_nothing_more(wires: Wires) -> None:
    m = wires.m
    wires.add(1, "long", 1000)
    assert isinstance(wires.recv(1), m.EngineOutputs)  # it runs
    wires.send(0, m.ClientGone(1))
    wires.add(0, "next", 3)
    got0, _ = wires.until_finished(0, {"next"})
    assert len(got0["next"]) == 3
    stats = wires.stats(0)
    assert stats.num_aborted == 1 and stats.num_running == 0
    while wires.pending(1):  # what was already on its way before ClientGone
        msg = wires.recv(1)
        assert isinstance(msg, m.EngineOutputs) and {o.request_id for o in msg.all_outputs()} <= {"long"}
    wires.send(1, m.GetStats(seq=1, client_index=1))  # a gone process's late message is not answered
    wires.stats(0)  # (the loop has handled it once it answers this)
    assert not wires.pending(1)


def test_a_request_the_engine_cannot_read_is_refused_alone(wires: Wires) -> None:
    """An AddRequest whose fields do not fit their types (a request field the API process let through unchecked)
    is a 400 for that request, sent to the process that sent it; the loop keeps serving (it used to stop the engine:
    every later request got a 503). A frame that is not msgpack at all is dropped."""
    import msgspec

    m = wires.m
    wires.add(1, "running", 8)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    raw = msgspec.msgpack.decode(wires.enc.encode(m.AddRequest("bad", [5, 9], params, client_index=1)))
    raw["sampling_params"]["temperature"] = "hot"
    wires.ins[1].send(msgspec.msgpack.encode(raw))
    wires.ins[0].send(b"\xc1 not msgpack")
    wires.add(0, "after", 3)
    got1, others1 = wires.until_finished(1, {"running", "bad"})
    (error,) = others1
    assert isinstance(error, m.RequestError) and error.request_id == "bad" and error.status == 400
    assert error.message.startswith("The request has a field the engine cannot take: ")
    assert "temperature" in error.message
    assert len(got1["running"]) == 8
    got0, others0 = wires.until_finished(0, {"after"})
    assert len(got0["after"]) == 3 and not others0
    assert wires.thread.is_alive()


def test_structured_output_errors_name_the_field_the_client_sent(wires: Wires) -> None:
    """A spec refused in add_request (validation) or after it (a compile that allows no text) comes back naming
    the request field it came from, as message and `param` (once always "structured_outputs.json", param null)."""
    from pagedllm.structured_output import StructuredOutputsParams

    m = wires.m
    specs = {"schema": StructuredOutputsParams(json={"type": "nope"}, origin="response_format.json_schema.schema"),
             "empty": StructuredOutputsParams(regex="[^\\x00-\\U0010FFFF]", origin="guided_regex"),
             "plain": StructuredOutputsParams(grammar="root ::= missing")}
    for rid, so in specs.items():
        params = SamplingParams(max_tokens=4, temperature=0, structured_outputs=so)
        wires.send(0, m.AddRequest(rid, [5, 9, 33, 7], params, client_index=0))
    _, errors = wires.until_finished(0, set(specs))
    by_id = {e.request_id: e for e in errors}
    assert by_id["schema"].param == "response_format", by_id["schema"]
    assert by_id["schema"].message.startswith("Invalid response_format.json_schema.schema: ")
    assert by_id["empty"].param == "guided_regex"
    assert by_id["empty"].message == "Invalid guided_regex: it matches no text at all, so nothing can be generated."
    assert by_id["plain"].param == "structured_outputs"
    assert by_id["plain"].message.startswith("Invalid structured_outputs.grammar: ")
