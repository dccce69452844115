"""OutputProcessor: engine-core outputs -> user-facing RequestOutputs (shared by LLM and the API server).

Per engine request it keeps the output token ids, the incremental detokenizer, logprobs and the
finish state; it enforces stop strings (which the engine core cannot see: it has no text) and tells
the caller which requests to abort in the core because a stop string ended them.

n > 1: the caller adds one engine request per sample (child ids like f"{i}_{parent_id}", index i,
all children added before the next process_outputs call); the processor reports one RequestOutput for
the parent, outputs sorted by index, finished once every child is.

Output kinds:
  * "cumulative": every update carries the full text / token ids / logprobs so far
  * "delta": every update carries only what is new since the previous update (streaming)
  * "final_only": one RequestOutput when the request finishes
While a request runs, the last (longest stop string - 1) characters are held back so that a stop
string that is still being generated never reaches the user.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pagedllm.core.batch_plan import EngineCoreOutput, TokenLogprobs
from pagedllm.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams

_OUTPUT_KINDS = ("cumulative", "delta", "final_only")


def _shown_ids(new_ids: Any, out: Any, params: Any, special_ids: set) -> Any:
    """The new tokens whose text the output carries: all but the one the engine stopped on (a stop_token_id, or an
    end-of-sequence id: special tokens), unless include_stop_str_in_output, as vLLM (the id stays in token_ids). A
    grammar that completes on an ordinary token (finish_reason "stop" too) keeps it."""
    if out.finish_reason == "stop" and new_ids and not params.include_stop_str_in_output:
        last = new_ids[-1]
        if last == out.stop_reason or (out.stop_reason is None and last in special_ids):
            return new_ids[:-1]
    return new_ids


def find_stop_string(text: str, num_new_chars: int, stops: list[str],
                     include_stop_str_in_output: bool) -> Optional[tuple[str, int]]:
    """The stop string that ends first in the last num_new_chars of text -> (stop, length to keep).

    The first to end is the one a step of one character at a time would have met first, so the result does not
    depend on how the text arrives (a step of several tokens: speculative decoding): with stops "b" and "abc", "xabc"
    stops at "b" ("xa") whether "abc" came as one token or three. A tie (stops ending at the same character): the
    one starting first. (vLLM takes the first in list order that occurs anywhere in the new text.)"""
    best: Optional[tuple[int, int, str]] = None  # (end, start, stop)
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        pos = text.find(stop, start)
        if pos != -1 and (best is None or (pos + len(stop), pos) < best[:2]):
            best = (pos + len(stop), pos, stop)
    if best is None:
        return None
    end, pos, stop = best
    return stop, end if include_stop_str_in_output else pos


@dataclass(eq=False)
class _ParentState:
    request_id: str
    output_kind: str
    # index -> latest cumulative CompletionOutput of that child (None until it produced something)
    latest: dict[int, Optional[CompletionOutput]] = field(default_factory=dict)
    child_ids: set[str] = field(default_factory=set)
    unfinished_child_ids: set[str] = field(default_factory=set)


@dataclass(eq=False)
class _RequestState:
    request_id: str
    index: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: str
    parent: Optional[_ParentState]
    detokenizer: Optional[IncrementalDetokenizer]
    metrics: RequestMetrics
    stop_buffer_len: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    num_cached_tokens: int = 0
    # prompt_logprobs: None for position 0, then {token id: Logprob} per prompt position (when asked for).
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    pooled: Optional[list[float]] = None  # an embedding request's pooled hidden state (pooling/)
    # What the user has already received (delta mode).
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    # final_only, no stop strings, no logprobs: until it finishes a step only appends its token ids (the text, if
    # any, is decoded when it finishes: the same incremental steps, in one pass).
    tokens_only: bool = False
    # delta, no stop strings, no logprobs, no siblings (a plain stream): a step's output is its new ids and the
    # text they complete; nothing accumulates (_plain_output).
    plain: bool = False
    # A plain stream's writer, while it can take a running step's (text, number of new ids) directly: True when
    # it took them (no RequestOutput is built), False to have them reported as usual (set_sink).
    sink: Optional[Callable[[str, int], bool]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _position_logprobs(entry: TokenLogprobs, k: int, detok: Optional[IncrementalDetokenizer]) -> dict[int, Logprob]:
    """One position's {token id: Logprob}: the chosen token first, then up to k top tokens (no repeats; k=-1: all
    the engine sent, the whole vocabulary)."""
    ids = entry.token_ids if k == -1 else entry.token_ids[:k + 1]
    strs = detok.decode_tokens(ids) if detok is not None else [None] * len(ids)
    position: dict[int, Logprob] = {}
    for token_id, logprob, rank, text in zip(ids, entry.logprobs, entry.ranks, strs):
        if token_id not in position:
            position[token_id] = Logprob(logprob=logprob, rank=rank, decoded_token=text)
    return position


class OutputProcessor:
    """Turns EngineCoreOutputs into RequestOutputs. Not thread-safe: one owner calls it."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.special_ids = set(getattr(tokenizer, "all_special_ids", None) or ())  # (EOS among them)
        self._requests: dict[str, _RequestState] = {}
        self._parents: dict[str, _ParentState] = {}
        self._token_strs: dict[int, str] = {}  # decoded single tokens, for logprobs
        self.stopped_by_string: set[str] = set()  # (set by each process_outputs call)

    # ------------------------------------------------------------------ bookkeeping
    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, *, parent_id: Optional[str] = None, index: int = 0,
                    output_kind: Optional[str] = None, arrival_time: Optional[float] = None) -> None:
        if request_id in self._requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        output_kind = output_kind or params.output_kind
        if output_kind not in _OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {_OUTPUT_KINDS}, got {output_kind!r}.")
        detokenize = self.tokenizer is not None and params.detokenize
        if params.stop and not detokenize:
            raise ValueError("Stop strings need detokenization: load a tokenizer and keep detokenize=True, "
                             "or use stop_token_ids.")
        detokenizer = None
        if detokenize:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                 params.spaces_between_special_tokens,
                                                 token_str_cache=self._token_strs)
        parent = None
        if parent_id is not None:
            parent = self._parents.get(parent_id)
            if parent is None:
                parent = self._parents[parent_id] = _ParentState(parent_id, output_kind)
            parent.latest[index] = None
            parent.child_ids.add(request_id)
            parent.unfinished_child_ids.add(request_id)
        stop_buffer_len = 0
        if params.stop and not params.include_stop_str_in_output:
            stop_buffer_len = max(len(s) for s in params.stop) - 1
        wants_logprobs = params.logprobs is not None
        self._requests[request_id] = _RequestState(
            request_id=request_id, index=index, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
            params=params, output_kind=output_kind, parent=parent, detokenizer=detokenizer,
            metrics=RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic()),
            stop_buffer_len=stop_buffer_len, logprobs=[] if wants_logprobs else None,
            cumulative_logprob=0.0 if wants_logprobs else None,
            tokens_only=(output_kind == "final_only" and not params.stop and not wants_logprobs
                         and params.prompt_logprobs is None and params.pooling is None),
            plain=(output_kind == "delta" and parent is None and not wants_logprobs and not params.stop
                   and params.prompt_logprobs is None and params.pooling is None),
        )

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Drop state of these requests (parent ids drop all their children). Returns the engine ids dropped."""
        dropped: list[str] = []
        for rid in request_ids:
            parent = self._parents.pop(rid, None)
            child_ids = sorted(parent.child_ids) if parent is not None else [rid]
            for cid in child_ids:
                state = self._requests.pop(cid, None)
                if state is None:
                    continue
                dropped.append(cid)
                if state.parent is not None and parent is None:  # one child of a live parent
                    state.parent.child_ids.discard(cid)
                    state.parent.unfinished_child_ids.discard(cid)
                    state.parent.latest.pop(state.index, None)
                    if not state.parent.child_ids:
                        self._parents.pop(state.parent.request_id, None)
        return dropped

    def set_sink(self, request_id: str, sink: Optional[Callable[[str, int], bool]]) -> bool:
        """Hand a plain stream's running steps to `sink` (None: stop). False when the request is not a running
        plain stream (then nothing changes)."""
        state = self._requests.get(request_id)
        if state is None or not state.plain:
            return False
        state.sink = sink
        return True

    def clear_sink(self, request_id: str, sink: Callable[[str, int], bool]) -> None:
        """Stop handing the request's steps to `sink` (if it is still the request's sink: ids can be reused)."""
        state = self._requests.get(request_id)
        if state is not None and state.sink is sink:
            state.sink = None

    def has_parents(self) -> bool:
        """Whether a request with several samples (n > 1) is running."""
        return bool(self._parents)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ the step
    def process_step(self, ids: list[str], tokens: list[int], cached: list[int],
                     now: Optional[float] = None) -> tuple[list[RequestOutput], list[str]]:
        """process_outputs for a step's columns (messages.EngineOutputs.step_ids: each request running, one new
        token, its num_cached_tokens): a direct stream's step here, in one loop; any other request's output is
        rebuilt as its EngineCoreOutput and goes through process_outputs (all of them in one call)."""
        if now is None:
            now = time.monotonic()
        results: list[RequestOutput] = []
        others: list[EngineCoreOutput] = []
        requests = self._requests
        for request_id, token_id, num_cached in zip(ids, tokens, cached):
            state = requests.get(request_id)
            if state is None:  # aborted by the user meanwhile
                continue
            if state.sink is None:  # only a plain stream has one
                others.append(EngineCoreOutput(request_id, [token_id], num_cached_tokens=num_cached))
                continue
            result = self._direct_step(state, token_id, num_cached, now)
            if result is not None:
                results.append(result)
        if not others:
            return results, []
        more, to_abort = self.process_outputs(others, now)
        results.extend(more)
        return results, to_abort

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        now: Optional[float] = None) -> tuple[list[RequestOutput], list[str]]:
        """Apply one engine step's outputs. Returns (outputs for the user, engine ids to abort)."""
        if now is None:
            now = time.monotonic()
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        # Requests the engine finished in this call whose stop string the same step completed: their finish_reason
        # is "stop" (the caller's metrics read it; the engine said "length" or the like).
        self.stopped_by_string = set()
        parent_updates: dict[str, list[tuple[_RequestState, Optional[CompletionOutput]]]] = {}
        requests = self._requests
        for out in outputs:
            state = requests.get(out.request_id)
            if state is None:  # aborted by the user meanwhile
                continue
            if state.plain:
                new_ids = out.new_token_ids
                if state.sink is not None and out.finish_reason is None and len(new_ids) == 1:
                    # A direct stream's running step of one token (the common case), in this loop.
                    result = self._direct_step(state, new_ids[0], out.num_cached_tokens, now)
                    if result is not None:
                        results.append(result)
                    continue
                result = self._plain_output(state, out, now)
                if result is not None:
                    results.append(result)
                continue
            if state.tokens_only:
                if out.finish_reason is None:  # nothing to report yet (offline)
                    new_ids = out.new_token_ids
                    if new_ids:
                        metrics = state.metrics
                        if metrics.first_token_time is None:
                            metrics.first_token_time = now
                        metrics.last_token_time = now
                        state.token_ids.extend(new_ids)
                    if out.num_cached_tokens and out.num_cached_tokens > state.num_cached_tokens:
                        state.num_cached_tokens = out.num_cached_tokens
                    continue
                if state.detokenizer is not None and state.token_ids:  # the text of the tokens kept so far
                    state.text = state.detokenizer.update(state.token_ids)
            stopped_by_string = self._update(state, out, now)
            if stopped_by_string:
                if out.finished:
                    self.stopped_by_string.add(out.request_id)
                else:
                    to_abort.append(out.request_id)
            completion = self._make_completion(state)
            if state.finished:
                self._requests.pop(state.request_id, None)
            if state.parent is not None:
                parent_updates.setdefault(state.parent.request_id, []).append((state, completion))
            elif completion is not None:
                results.append(self._request_output(state, state.request_id, [completion], state.finished))
        for parent_id, updates in parent_updates.items():
            result = self._parent_output(self._parents[parent_id], updates)
            if result is not None:
                results.append(result)
        return results, to_abort

    def _plain_output(self, state: _RequestState, out: EngineCoreOutput, now: float) -> Optional[RequestOutput]:
        """A plain stream's step (see _RequestState.plain): the same output _update + _make_completion give in
        delta mode, without keeping the text and ids it already sent."""
        new_ids = out.new_token_ids
        text = ""
        metrics = state.metrics
        if new_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            state.num_sent_tokens += len(new_ids)
            if state.detokenizer is not None:
                detokenizer = state.detokenizer
                shown = _shown_ids(new_ids, out, state.params, self.special_ids)
                text = (detokenizer.step_text(shown[0]) if len(shown) == 1 else
                        detokenizer.update(shown) if shown else "")
        if out.finish_reason is not None and state.detokenizer is not None:
            text += state.detokenizer.flush(keep=False)  # the end of the text: what the steps held back
        if out.num_cached_tokens and out.num_cached_tokens > state.num_cached_tokens:
            state.num_cached_tokens = out.num_cached_tokens
        finish_reason = out.finish_reason
        if finish_reason is not None:
            state.finish_reason, state.stop_reason = finish_reason, out.stop_reason
            metrics.finished_time = now
            del self._requests[state.request_id]
        elif not new_ids:
            return None
        elif state.sink is not None and state.sink(text, len(new_ids)):
            return None
        return self._plain_request_output(state, text, new_ids, finish_reason, out.stop_reason)

    def _direct_step(self, state: _RequestState, token_id: int, num_cached: int, now: float
                     ) -> Optional[RequestOutput]:
        """What _plain_output does for a direct stream's running step of one token: its text straight to the sink;
        a RequestOutput only when the sink declines it (the writer's queued path)."""
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        state.num_sent_tokens += 1
        if num_cached > state.num_cached_tokens:
            state.num_cached_tokens = num_cached
        text = state.detokenizer.step_text(token_id) if state.detokenizer is not None else ""
        if state.sink(text, 1):
            return None
        return self._plain_request_output(state, text, [token_id], None, None)

    @staticmethod
    def _plain_request_output(state: _RequestState, text: str, new_ids: Any, finish_reason: Optional[str],
                              stop_reason: Any) -> RequestOutput:
        completion = CompletionOutput(state.index, text, list(new_ids), None, None, finish_reason, stop_reason)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, None, [completion],
                             finish_reason is not None, state.num_cached_tokens, state.metrics)

    def _update(self, state: _RequestState, out: EngineCoreOutput, now: float) -> bool:
        """Append tokens, text and logprobs; set the finish state. True when a stop string ended it."""
        new_ids = out.new_token_ids
        if new_ids:
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens or 0)
        state.token_ids.extend(new_ids)
        if out.prompt_logprobs is not None and state.params.prompt_logprobs is not None:
            self._set_prompt_logprobs(state, *out.prompt_logprobs)
        if out.pooled is not None:
            state.pooled = out.pooled
        if state.logprobs is not None and out.new_logprobs:
            self._append_logprobs(state, out.new_logprobs)
        stopped_by_string = False
        if state.detokenizer is not None and (new_ids or out.finished):
            params = state.params
            shown = _shown_ids(new_ids, out, params, self.special_ids)
            # As vLLM: the text of the first min_tokens tokens is never searched for stop strings (a match may
            # start in it only if it ends in a later token), however many tokens a step brings.
            within = 0
            if params.stop and params.min_tokens:
                within = min(max(params.min_tokens - (len(state.token_ids) - len(new_ids)), 0), len(shown))
                if within:
                    state.text += state.detokenizer.update(shown[:within])
            rest = shown[within:]
            # Several tokens in one step (speculative decoding) under stop strings: searched token by token, so the
            # tokens after the one that completes a stop string are dropped from token_ids and logprobs (they were
            # kept: token_ids then depended on how many drafts a step accepted).
            pieces = [rest[j:j + 1] for j in range(len(rest))] if params.stop and len(rest) > 1 else [rest]
            for j, piece in enumerate(pieces):
                delta = state.detokenizer.update(piece) if piece else ""
                if out.finished and j == len(pieces) - 1:  # the end of the text: what the steps held back
                    delta += state.detokenizer.flush()
                state.text += delta
                if delta and params.stop:
                    found = find_stop_string(state.text, len(delta), params.stop, params.include_stop_str_in_output)
                    if found is not None:
                        stop, keep = found
                        state.text = state.text[:keep]
                        state.finish_reason, state.stop_reason = "stop", stop
                        stopped_by_string = True
                        if piece:  # (also a lone shown token followed by a hidden EOS / stop id of the same step)
                            self._drop_last_tokens(state, len(new_ids) - (within + j + 1))
                        break
        if not stopped_by_string and out.finished:
            state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
        if state.finished:
            state.metrics.finished_time = now
        return stopped_by_string

    @staticmethod
    def _drop_last_tokens(state: _RequestState, n: int) -> None:
        """Forget the last n tokens of this step (past a stop string): their ids, logprobs and cumulative logprob."""
        if n <= 0:
            return
        keep = len(state.token_ids) - n
        if state.logprobs is not None and len(state.logprobs) > keep:
            for token_id, entry in zip(state.token_ids[keep:], state.logprobs[keep:]):
                logprob = entry.get(token_id) if isinstance(entry, dict) else None
                if logprob is not None and state.cumulative_logprob is not None:
                    state.cumulative_logprob -= logprob.logprob
            del state.logprobs[keep:]
        del state.token_ids[keep:]

    def _set_prompt_logprobs(self, state: _RequestState, first: int, entries: list[TokenLogprobs]) -> None:
        # Positions may arrive twice (a preempted request recomputes its prompt): the later write wins.
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None] * len(state.prompt_token_ids)
        k = state.params.prompt_logprobs or 0
        for j, entry in enumerate(entries):
            if first + j < len(state.prompt_logprobs):
                state.prompt_logprobs[first + j] = _position_logprobs(entry, k, state.detokenizer)

    def _append_logprobs(self, state: _RequestState, new_logprobs: list[TokenLogprobs]) -> None:
        k = state.params.logprobs or 0
        for entry in new_logprobs:
            state.logprobs.append(_position_logprobs(entry, k, state.detokenizer))
            if entry.logprobs:
                state.cumulative_logprob += entry.logprobs[0]

    # ------------------------------------------------------------------ building outputs
    def _make_completion(self, state: _RequestState) -> Optional[CompletionOutput]:
        """The CompletionOutput to report now for this request, or None if nothing is due."""
        finished = state.finished
        if state.output_kind == "final_only" and not finished:
            return None
        visible = len(state.text) if finished else max(len(state.text) - state.stop_buffer_len, 0)
        if state.output_kind != "delta":
            return CompletionOutput(
                index=state.index, text=state.text[:visible], token_ids=list(state.token_ids),
                cumulative_logprob=state.cumulative_logprob,
                logprobs=list(state.logprobs) if state.logprobs is not None else None,
                finish_reason=state.finish_reason, stop_reason=state.stop_reason)
        start_chars = min(state.num_sent_chars, visible)
        start_tokens = state.num_sent_tokens
        if start_tokens == len(state.token_ids) and start_chars == visible and not finished:
            return None
        state.num_sent_chars = max(visible, state.num_sent_chars)
        state.num_sent_tokens = len(state.token_ids)
        return CompletionOutput(
            index=state.index, text=state.text[start_chars:visible], token_ids=state.token_ids[start_tokens:],
            cumulative_logprob=state.cumulative_logprob,
            logprobs=state.logprobs[start_tokens:] if state.logprobs is not None else None,
            finish_reason=state.finish_reason, stop_reason=state.stop_reason)

    @staticmethod
    def _request_output(state: _RequestState, request_id: str, completions: list[CompletionOutput],
                        finished: bool) -> RequestOutput:
        return RequestOutput(request_id=request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
                             prompt_logprobs=(state.prompt_logprobs if state.prompt_logprobs is not None else
                                              [None] * len(state.prompt_token_ids)
                                              if state.params.prompt_logprobs is not None else None),
                             outputs=completions, finished=finished,
                             num_cached_tokens=state.num_cached_tokens, metrics=state.metrics, pooled=state.pooled)

    def _parent_output(self, parent: _ParentState,
                       updates: list[tuple[_RequestState, Optional[CompletionOutput]]]) -> Optional[RequestOutput]:
        for state, completion in updates:
            if state.finished:
                parent.unfinished_child_ids.discard(state.request_id)
            if completion is not None:
                parent.latest[state.index] = completion
        finished = not parent.unfinished_child_ids
        if finished:
            self._parents.pop(parent.request_id, None)
        last_state = updates[-1][0]
        if parent.output_kind == "delta":
            completions = sorted((c for _, c in updates if c is not None), key=lambda c: c.index)
            if not completions:
                return None
        elif parent.output_kind == "final_only" and not finished:
            return None
        else:
            completions = [c if c is not None else self._empty_completion(index, last_state.params)
                           for index, c in sorted(parent.latest.items())]
        return self._request_output(last_state, parent.request_id, completions, finished)

    @staticmethod
    def _empty_completion(index: int, params: SamplingParams) -> CompletionOutput:
        wants_logprobs = params.logprobs is not None
        return CompletionOutput(index=index, text="", token_ids=[],
                                cumulative_logprob=0.0 if wants_logprobs else None,
                                logprobs=[] if wants_logprobs else None)
