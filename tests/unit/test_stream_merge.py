"""A stream's queued outputs are folded into one when the API process is behind (entrypoints/stream_merge.py):
nothing is lost or reordered, an error stays behind the output before it, finished outputs end the fold."""
from __future__ import annotations

import asyncio
from collections import deque

from pagedllm.entrypoints.stream_merge import coalesce, merge_delta
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


def _out(chunks: dict[int, tuple[str, list[int]]], finished: bool = False, lp: bool = False,
         prompt_logprobs=None) -> RequestOutput:
    outs = []
    for index, (text, ids) in sorted(chunks.items()):
        logprobs = [{t: Logprob(-1.0)} for t in ids] if lp else None
        outs.append(CompletionOutput(index=index, text=text, token_ids=list(ids), cumulative_logprob=-len(ids) if lp
                                     else None, logprobs=logprobs, finish_reason="length" if finished else None))
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], prompt_logprobs=prompt_logprobs,
                         outputs=outs, finished=finished)


def test_merge_delta_concatenates_per_sample():
    a = _out({0: ("He", [1]), 1: ("x", [7])}, lp=True, prompt_logprobs=[None])
    b = _out({0: ("llo", [2, 3])}, lp=True)
    c = _out({1: ("y", [8]), 2: ("z", [9])}, lp=True)
    m = merge_delta(merge_delta(a, b), c)
    assert [(o.index, o.text, o.token_ids) for o in m.outputs] == [(0, "Hello", [1, 2, 3]), (1, "xy", [7, 8]),
                                                                   (2, "z", [9])]
    assert [list(d) for d in m.outputs[0].logprobs] == [[1], [2], [3]]
    assert m.outputs[0].cumulative_logprob == -2  # the latest cumulative value
    assert m.prompt_logprobs == [None]  # the first output's prompt logprobs survive


def test_coalesce_folds_waiting_outputs_and_keeps_an_error_behind():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        held: deque = deque()
        first = _out({0: ("a", [1])})
        for item in (_out({0: ("b", [2])}), _out({0: ("c", [3])}), RuntimeError("engine died"),
                     _out({0: ("d", [4])})):
            q.put_nowait(item)
        merged = coalesce(first, q, held, "delta")
        assert merged.outputs[0].text == "abc" and merged.outputs[0].token_ids == [1, 2, 3]
        assert isinstance(held[0], RuntimeError) and q.qsize() == 1  # the output after the error stays queued
        # A finished output ends the fold: what follows is not this request's any more.
        q2: asyncio.Queue = asyncio.Queue()
        q2.put_nowait(_out({0: ("z", [5])}))
        done = _out({0: ("!", [9])}, finished=True)
        assert coalesce(done, q2, deque(), "delta") is done and q2.qsize() == 1
        # final_only never folds; cumulative keeps the latest.
        q3: asyncio.Queue = asyncio.Queue()
        latest = _out({0: ("abc", [1, 2, 3])})
        q3.put_nowait(latest)
        assert coalesce(_out({0: ("a", [1])}), q3, deque(), "cumulative") is latest
        q3.put_nowait(latest)
        assert coalesce(first, q3, deque(), "final_only") is first and q3.qsize() == 1
    asyncio.run(run())
