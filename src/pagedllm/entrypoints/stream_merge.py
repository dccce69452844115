"""Coalescing a stream's queued outputs: when the API process falls behind the engine (many streams, slow
clients), one request may have several RequestOutputs waiting. They go out as one chunk carrying all their new
tokens and text, so the stream catches up at once instead of replaying a backlog step by step (each chunk costs
the SSE framing and a socket write). When the server keeps up, a queue holds at most one output: nothing changes.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from typing import Any

from pagedllm.outputs import CompletionOutput, RequestOutput


def merge_delta(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two delta-mode outputs of one request, b after a -> one output with a's then b's new content."""
    by_index = {c.index: c for c in a.outputs}
    for c in b.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        if prev.logprobs is not None and c.logprobs is not None:
            logprobs = prev.logprobs + c.logprobs
        else:
            logprobs = c.logprobs if c.logprobs is not None else prev.logprobs
        by_index[c.index] = CompletionOutput(
            index=c.index, text=prev.text + c.text, token_ids=prev.token_ids + c.token_ids,
            cumulative_logprob=c.cumulative_logprob, logprobs=logprobs, finish_reason=c.finish_reason,
            stop_reason=c.stop_reason, tool_calls=c.tool_calls if c.tool_calls is not None else prev.tool_calls)
    return dataclasses.replace(
        b, outputs=sorted(by_index.values(), key=lambda c: c.index),
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs)


def coalesce(item: RequestOutput, queue: asyncio.Queue, held: deque, output_kind: str) -> RequestOutput:
    """Fold the outputs already waiting in `queue` into `item` (delta: merged; cumulative: the latest wins).
    A waiting exception stops the fold and is put in `held`, to be raised after `item` is delivered."""
    if output_kind not in ("delta", "cumulative"):
        return item
    while not item.finished and not held:
        try:
            nxt: Any = queue.get_nowait()
        except asyncio.QueueEmpty:
            break
        if isinstance(nxt, BaseException):
            held.append(nxt)
            break
        item = merge_delta(item, nxt) if output_kind == "delta" else nxt
    return item
