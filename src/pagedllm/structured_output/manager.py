"""StructuredOutputManager: the engine core's side of structured outputs.

  * validate(params): cheap, synchronous, tokenizer-free: a bad schema / regex / grammar is refused in
    add_request with the library's reason (the server turns it into a 400).
  * submit(params): compile on a small thread pool (min(4, CPUs) workers, so one slow compile does not hold
    the others), cached by (backend, spec): equal specs compile once. The request waits in the scheduler's queue
    (not blocking others) until its grammar is ready. release(so) when a request goes away before its grammar
    is ready: a compile no request waits for any more is cancelled if still queued, or its result dropped.
  * bitmask(requests): after schedule(), one int32 [rows, ceil(V/32)] array for the requests that sample this
    step; it travels to the runner in the BatchPlan.
  * the scheduler advances each request's matcher with the tokens it appends (RequestStructuredOutput.accept).

The tokenizer and the library are loaded on the first structured request, in the compile thread: engines that
never see one pay nothing.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

import numpy as np

from pagedllm.structured_output.backend import (
    BACKENDS,
    GrammarBackend,
    RequestGrammar,
    backend_class,
    check_satisfiable,
    clean_error,
    resolve_backend_name,
)
from pagedllm.structured_output.params import SpecError, StructuredOutputsParams

logger = logging.getLogger("pagedllm")


def compile_workers() -> int:
    """Concurrent grammar compiles: a few, so a slow one (a regex of 20,000 alternatives) leaves the others a
    worker, and not more than the CPUs, which the engine's own threads need too."""
    return max(1, min(4, os.cpu_count() or 1))


def marker_end(tail: Sequence[int], marker: Sequence[int], token_ids: Sequence[int]) -> Optional[int]:
    """How many of token_ids, counted from the first, end with the first whole `marker` (the tokens before
    token_ids: `tail`, its last len(marker) - 1 of them matter); None: the marker does not end within them."""
    if len(marker) == 1:  # the usual case (one special token): a C scan
        try:
            return list(token_ids).index(marker[0]) + 1
        except ValueError:
            return None
    seq = list(tail[len(tail) - (len(marker) - 1):]) + list(token_ids)
    marker = list(marker)
    for i in range(len(marker), len(seq) + 1):
        if seq[i - len(marker):i] == marker:
            return i - len(seq) + len(token_ids)
    return None


class RequestStructuredOutput:
    """Per request (held by core.Request): its compile future, then its matcher.

    Duck-typed for the scheduler (core/ stays free of the grammar libraries): is_ready(), error,
    accept(token_ids), is_terminated(), rollback(n).

    With a reasoning end marker (params.reasoning_end, --reasoning-parser) the grammar waits for the reasoning:
    while `reasoning` is true the request samples freely (no bitmask row) and its matcher stays at its start state;
    the tokens after the marker are the grammar's first. Preemption keeps this object and the request's output, so
    the state stays right on resume."""

    def __init__(self, manager: "StructuredOutputManager", future: Future, key: tuple,
                 params: StructuredOutputsParams) -> None:
        self.manager = manager
        self.future = future
        self.key = key  # the compile cache's key, for release()
        self.params = params
        self.released = False
        self.grammar: Optional[RequestGrammar] = None
        self.error: Optional[str] = None
        self.error_param: Optional[str] = None  # the request field the error is about
        end = params.reasoning_end
        self.reasoning_end: Optional[tuple[int, ...]] = tuple(end) if end and not params.reasoning_ended else None
        self.reasoning = self.reasoning_end is not None  # inside the reasoning: the grammar has not started
        self._tail: list[int] = []  # a multi-token marker's possible start at the end of the output so far
        self._num_grammar = 0  # tokens the matcher took (rollback past them reopens the reasoning)

    def is_ready(self) -> bool:
        if self.grammar is not None:
            return True
        if self.error is not None or not self.future.done() or self.future.cancelled():
            return False
        try:
            backend, compiled = self.future.result()
            self.grammar = backend.new_grammar(compiled)
        except SpecError as e:  # worded for this request's field (the compile may be another request's)
            self.error, self.error_param = str(e.for_params(self.params)), self.params.param
            return False
        except Exception as e:  # noqa: BLE001 - reported to the user by the engine core
            self.error, self.error_param = clean_error(e), self.params.param
            return False
        return True

    @property
    def grammar_backend(self) -> GrammarBackend:
        return self.future.result()[0]

    def _after_reasoning(self, token_ids: Sequence[int]) -> Optional[int]:
        """Inside the reasoning: where among token_ids the grammar's part starts (None: not within them)."""
        return marker_end(self._tail, self.reasoning_end, token_ids)

    def ends_reasoning(self, token_ids: Sequence[int]) -> bool:
        return self._after_reasoning(token_ids) is not None

    def accept(self, token_ids: Sequence[int]) -> bool:
        if self.grammar is None:
            return False
        if self.reasoning:
            start = self._after_reasoning(token_ids)
            if start is None:
                if len(self.reasoning_end) > 1:
                    self._tail = (self._tail + list(token_ids))[-(len(self.reasoning_end) - 1):]
                return True  # reasoning: anything goes
            self.reasoning, self._tail = False, []
            token_ids = token_ids[start:]
            if not token_ids:
                return True
        ok = self.grammar.accept_tokens(token_ids)
        self._num_grammar += len(token_ids) if ok else 0
        return ok

    def is_terminated(self) -> bool:
        return not self.reasoning and self.grammar is not None and self.grammar.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if self.grammar is None:
            return
        n = min(num_tokens, self._num_grammar)
        self.grammar.rollback(n)
        self._num_grammar -= n
        if num_tokens > n and self.reasoning_end is not None:  # back before the marker: the reasoning again
            self.reasoning, self._tail = True, []  # (a multi-token marker's partial start is not restored)

    def validate(self, token_ids: Sequence[int]) -> int:
        """How many leading token_ids the grammar accepts from its present state (none past its end); no advance.
        Inside the reasoning: all up to its end marker, then those the grammar accepts from its start."""
        if self.grammar is None:
            return 0
        if self.reasoning:
            start = self._after_reasoning(token_ids)
            if start is None:
                return len(token_ids)
            return start + self.grammar.validate_tokens(token_ids[start:])
        return self.grammar.validate_tokens(token_ids)

    def fill_draft_rows(self, drafts: Sequence[int], bitmask: Any) -> None:
        """bitmask[j] = the allowed tokens after drafts[:j + 1] (a verify step's rows past its first), found by
        advancing the matcher through the drafts and rolling it back. Rows after a draft the grammar rejects, or
        after one that ends it, stay all ones: no accepted draft leads there, or the request stops before. Inside the
        reasoning, rows up to its end marker stay all ones too; the one after it is the grammar's start."""
        grammar = self.grammar
        start = 0
        if self.reasoning:
            start = self._after_reasoning(drafts)
            if start is None:
                return
            grammar.fill_bitmask(bitmask, start - 1)
            drafts = drafts[start:]
        n = grammar.validate_tokens(drafts)
        for j in range(n):
            grammar.accept_tokens([drafts[j]])
            if not grammar.is_terminated():
                grammar.fill_bitmask(bitmask, start + j)
        grammar.rollback(n)


class StructuredOutputManager:
    def __init__(self, tokenizer_source: str, vocab_size: int, stop_token_ids: list[int],
                 config: Optional[dict] = None, trust_remote_code: bool = False,
                 tokenizer_options: Optional[dict] = None) -> None:
        """tokenizer_options: get_tokenizer's keywords (tokenizer_mode, ...) for the engine's own tokenizer load."""
        config = dict(config or {})
        self.backend_name = config.pop("backend", "auto") or "auto"
        if self.backend_name not in BACKENDS:
            raise ValueError(f"--structured-outputs-config backend must be one of {', '.join(BACKENDS)}, got "
                             f"{self.backend_name!r}.")
        for key in ("disable_any_whitespace", "disable_additional_properties"):
            self.__dict__[key] = bool(config.pop(key, False))
        # vLLM's keys for the grammar after the reasoning: the server reads them (it gives each request its reasoning
        # end marker, StructuredOutputsParams.reasoning_end); the engine only follows the requests.
        parser = config.pop("reasoning_parser", None)
        if parser is not None and not isinstance(parser, str):
            raise ValueError(f"--structured-outputs-config reasoning_parser must be a parser's name, got {parser!r}.")
        if not isinstance(config.pop("enable_in_reasoning", False), bool):
            raise ValueError("--structured-outputs-config enable_in_reasoning must be true or false.")
        if config:
            raise ValueError(f"Unknown --structured-outputs-config key(s): {', '.join(sorted(config))}; known: "
                             "backend, disable_any_whitespace, disable_additional_properties, reasoning_parser, "
                             "enable_in_reasoning.")
        self.tokenizer_source = tokenizer_source
        self.trust_remote_code = trust_remote_code
        self.tokenizer_options = dict(tokenizer_options or {}, trust_remote_code=trust_remote_code)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._executor: Optional[ThreadPoolExecutor] = None
        self.max_workers = compile_workers()
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self._cache: dict[tuple, Future] = {}
        self._waiters: dict[tuple, int] = {}  # cache key -> requests that hold its pending compile
        self._validated: dict[tuple, str] = {}  # spec key -> backend name, for specs that passed validation
        self._tokenizer: Any = None

    # ------------------------------------------------------------------ requests
    def apply_defaults(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        if self.disable_any_whitespace and not params.disable_any_whitespace:
            params.disable_any_whitespace = True
        if self.disable_additional_properties and not params.disable_additional_properties:
            params.disable_additional_properties = True
        return params

    def validate(self, params: StructuredOutputsParams) -> str:
        """The backend that will compile it; ValueError with the library's reason if the spec is invalid."""
        key = params.key()
        name = self._validated.get(key)
        if name is None:
            check_satisfiable(params)
            name = resolve_backend_name(self.backend_name, params)
            if len(self._validated) > 4096:
                self._validated.clear()
            self._validated[key] = name
        return name

    def submit(self, params: StructuredOutputsParams) -> RequestStructuredOutput:
        backend = self.validate(params)
        key = (backend,) + params.key()
        future = self._cache.get(key)
        if future is None or future.cancelled() or (future.done() and future.exception() is not None):
            future = self._pool().submit(self._compile, backend, params)
            self._cache[key] = future
            self._waiters[key] = 0
        if not future.done():
            self._waiters[key] = self._waiters.get(key, 0) + 1
        return RequestStructuredOutput(self, future, key, params)

    def release(self, so: RequestStructuredOutput) -> None:
        """The request is gone (aborted, client disconnected): if no other request waits for its compile, the
        compile is cancelled while still queued, or its result dropped from the cache once it runs (the library
        cannot stop a running compile)."""
        if so.released:
            return
        so.released = True
        future = so.future
        if future.done() or self._cache.get(so.key) is not future:
            return
        left = self._waiters.get(so.key, 1) - 1
        if left > 0:
            self._waiters[so.key] = left
            return
        self._waiters.pop(so.key, None)
        del self._cache[so.key]
        future.cancel()

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="pagedllm-grammar")
        return self._executor

    def preload(self, tokenizer: Any = None) -> None:
        """Load the tokenizer (or take the caller's) and the default backend in the compile thread now, so the
        first structured request does not wait for them."""
        if tokenizer is not None and self._tokenizer is None:
            self._tokenizer = tokenizer
        name = "xgrammar" if self.backend_name == "auto" else self.backend_name
        self._pool().submit(self._backend, name)

    def _compile(self, backend_name: str, params: StructuredOutputsParams) -> tuple[GrammarBackend, Any]:
        backend = self._backend(backend_name)
        compiled = backend.compile(params)
        # A grammar that allows no first token (e.g. a regex of an empty character set) would leave the request
        # nothing to sample: refused with the spec's field instead of an aborted or errored request.
        probe = backend.allocate_bitmask(1)
        backend.new_grammar(compiled).fill_bitmask(probe, 0)
        if not bool(probe.any()):
            raise SpecError(params, "it matches no text at all, so nothing can be generated.")
        return backend, compiled

    def _backend(self, name: str) -> GrammarBackend:
        with self._backend_lock:
            if name not in self._backends:
                if self._tokenizer is None:
                    from pagedllm.tokenizer import get_tokenizer

                    self._tokenizer = get_tokenizer(self.tokenizer_source, **self.tokenizer_options)
                self._backends[name] = backend_class(name)(self._tokenizer, self.vocab_size, self.stop_token_ids)
                logger.info("Structured outputs: %s backend ready (vocab %d).", name, self.vocab_size)
            return self._backends[name]

    # ------------------------------------------------------------------ per step
    def bitmask(self, outputs: list[RequestStructuredOutput],
                drafts: Optional[Sequence[Sequence[int]]] = None) -> Any:
        """numpy int32 [rows, ceil(V/32)]: the allowed next tokens of each of outputs, one row each; with drafts
        (speculative decoding: per output, the drafts its verify step checks), 1 + len(drafts[i]) rows for
        outputs[i], one per verify position (fill_draft_rows)."""
        first_rows = self._first_rows(outputs)
        if not drafts or not any(drafts):
            return first_rows
        parts = []
        for i, (so, d) in enumerate(zip(outputs, drafts)):
            parts.append(first_rows[i:i + 1])
            if d:
                rows = so.grammar_backend.allocate_bitmask(len(d))
                so.fill_draft_rows(d, rows)
                parts.append(rows.numpy())
        return np.concatenate(parts)

    def _first_rows(self, outputs: list[RequestStructuredOutput]) -> Any:
        by_backend: dict[int, list[int]] = {}
        for i, so in enumerate(outputs):
            if not so.reasoning:  # (inside the reasoning: its row stays all ones)
                by_backend.setdefault(id(so.grammar_backend), []).append(i)
        first = outputs[0].grammar_backend
        bitmask = first.allocate_bitmask(len(outputs))
        if len(by_backend) == 1 and len(next(iter(by_backend.values()))) == len(outputs):
            first.fill_bitmasks([so.grammar for so in outputs], bitmask)
        else:  # mixed backends in one batch (auto fell back for some specs): fill each group in place
            for rows in by_backend.values():
                backend = outputs[rows[0]].grammar_backend
                part = backend.allocate_bitmask(len(rows))
                backend.fill_bitmasks([outputs[r].grammar for r in rows], part)
                bitmask[rows] = part
        return bitmask.numpy()

    def wait_for_compiles(self, outputs: list[RequestStructuredOutput], timeout: float) -> None:
        """Block up to timeout for one of these compiles (the engine has nothing else to run)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        pending = [so.future for so in outputs if not so.future.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        """Stop the compile threads: queued compiles are cancelled, running ones are waited for (the threads must
        not outlive the engine)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
