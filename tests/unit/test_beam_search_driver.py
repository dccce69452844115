"""The async beam-search driver: one request per live beam per step, stopping when the client leaves."""
from __future__ import annotations

import asyncio

import pytest

from pagedllm.beam_search.driver import ClientDisconnected, run_async
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams


def _fake_generate(calls):
    async def generate(seq, params):
        calls.append(list(seq))
        # token t has logprob -t/10 for t in 2..9: beams extend with the likeliest tokens
        lps = {t: Logprob(-t / 10, rank=t - 1) for t in range(2, 2 + params.logprobs)}
        out = CompletionOutput(index=0, text="", token_ids=[2], cumulative_logprob=None, logprobs=[lps])
        return RequestOutput("r", None, list(seq), None, [out], True)
    return generate


def test_run_async_searches_and_stops_when_disconnected():
    calls: list = []
    result = asyncio.run(run_async(_fake_generate(calls), [5, 6], BeamSearchParams(beam_width=2, max_tokens=3),
                                   eos_token_ids=[1]))
    assert [s.tokens for s in result.sequences] == [[5, 6, 2, 2, 2], [5, 6, 2, 2, 3]]
    assert len(calls) == 1 + 2 + 2  # one live beam at first, then two per step

    asked = []

    async def disconnected():
        asked.append(1)
        return len(asked) > 2

    calls.clear()
    with pytest.raises(ClientDisconnected):  # (the routes answer it quietly, no traceback)
        asyncio.run(run_async(_fake_generate(calls), [5, 6], BeamSearchParams(beam_width=2, max_tokens=50),
                              eos_token_ids=[1], disconnected=disconnected))
    assert len(calls) == 1 + 2  # two steps ran, the third saw the client gone
