"""The engine core's structured-output steps, kept out of the step loop's body.

Pure Python: the grammar library is reached only through structured_output.manager, imported on the first
request under a grammar. Per step (only once such a request was seen): report compiles that failed, attach the
grammar bitmask of the scheduled requests that sample to the BatchPlan, and when the plan is empty because
every waiting request is still compiling, wait briefly for a compile instead of spinning.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from pagedllm.core.batch_plan import BatchPlan
from pagedllm.core.request import Request, RequestStatus

logger = logging.getLogger("pagedllm")

_IDLE_WAIT_S = 0.02


class StructuredOutputHooks:
    def __init__(self, core: Any, engine_args: Any) -> None:
        self.core = core
        self.engine_args = engine_args
        self.manager: Optional[Any] = None
        self.tokenizer: Optional[Any] = None  # the offline LLM hands its tokenizer over (no second load)
        self._compiling: dict[str, Request] = {}
        self._live: dict[str, Request] = {}  # unfinished requests under a grammar: the per-step work is O(these)
        self._errors: list[tuple[str, str, Optional[str]]] = []  # (request id, message, request field)
        config = getattr(engine_args, "structured_outputs_config", None)
        if config:  # check the flag at start-up, not on the first request
            self._get_manager()

    def _get_manager(self) -> Any:
        if self.manager is None:
            from pagedllm.structured_output.manager import StructuredOutputManager
            from pagedllm.tokenizer import engine_tokenizer_options, engine_tokenizer_source

            args = self.engine_args
            self.manager = StructuredOutputManager(
                engine_tokenizer_source(args, self.core.model_dir), self.core.vocab_size, list(self.core.eos_token_ids),
                config=getattr(args, "structured_outputs_config", None), trust_remote_code=args.trust_remote_code,
                tokenizer_options=engine_tokenizer_options(args))
        if self.tokenizer is not None and self.manager._tokenizer is None:
            self.manager._tokenizer = self.tokenizer
        return self.manager

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Grammars from now on compile against `tokenizer` (LLM.set_tokenizer): the manager, whose backends and
        compiled grammars hold the old vocabulary and EOS, is dropped and built again on the next request."""
        self.tokenizer = tokenizer
        if self.manager is not None:
            self.manager.shutdown()
            self.manager = None

    def preload(self, tokenizer: Any = None) -> None:
        """Warm the grammar library up in the background (the server calls this once the engine is ready)."""
        try:
            self._get_manager().preload(tokenizer)
        except Exception:  # noqa: BLE001 - a missing library shows on the first structured request instead
            logger.debug("structured outputs preload failed", exc_info=True)

    def validate(self, params: Any) -> None:
        """ValueError (-> 400) if the request's spec is invalid; cheap and tokenizer-free."""
        manager = self._get_manager()
        manager.validate(manager.apply_defaults(params.structured_outputs))  # SpecError names its field

    def submit(self, request: Request) -> Any:
        manager = self._get_manager()
        so = manager.submit(manager.apply_defaults(request.sampling_params.structured_outputs))
        self._compiling[request.request_id] = request
        self._live[request.request_id] = request
        return so

    def before_schedule(self) -> None:
        if not self._compiling:
            return
        for rid, request in list(self._compiling.items()):
            so = request.structured_output
            if so.is_ready():
                del self._compiling[rid]
            elif so.error is not None:
                del self._compiling[rid]
                logger.info("Request %s: its grammar did not compile: %s", rid, so.error)
                self._errors.append((rid, so.error, so.error_param))
                self.core.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            elif request.is_finished or rid not in self.core.scheduler.requests:
                del self._compiling[rid]  # finished while compiling (abort_requests released it already)
                self.manager.release(so)

    def release(self, request_ids: list[str]) -> None:
        """Requests being aborted: their pending compiles are dropped (not started if still queued), so a client
        that went away does not keep a compile worker busy."""
        if not self._compiling or self.manager is None:
            return
        for rid in request_ids:
            request = self._compiling.pop(rid, None)
            if request is not None:
                self.manager.release(request.structured_output)

    def idle_wait(self) -> None:
        if self._compiling and self.manager is not None:
            self.manager.wait_for_compiles([r.structured_output for r in self._compiling.values()], _IDLE_WAIT_S)

    def _prune(self) -> None:
        requests = self.core.scheduler.requests
        for rid in [r for r, req in self._live.items() if requests.get(r) is not req]:
            del self._live[rid]

    def plan_has_grammar(self, plan: BatchPlan) -> bool:
        if not self._live:
            return False
        scheduled = plan.num_scheduled_tokens
        return any(rid in scheduled for rid in self._live)

    def attach_bitmask(self, plan: BatchPlan) -> None:
        if not self._live:
            return
        self._prune()
        scheduled = plan.num_scheduled_tokens
        spec_tokens = plan.scheduled_spec_decode_tokens
        rows: dict[str, int] = {}  # request id -> its first row (a verify step: 1 + its drafts rows from there)
        outputs = []
        drafts: list = []
        num_rows = 0
        for rid, request in self._live.items():
            so = request.structured_output
            # Only scheduled requests that sample this step (not mid-prefill) and whose grammar is still open.
            if rid not in scheduled or so.grammar is None or request.num_computed_tokens < request.num_tokens \
                    or so.is_terminated():
                continue
            d = spec_tokens.get(rid, ()) if spec_tokens else ()
            if so.reasoning and not (d and so.ends_reasoning(d)):
                continue  # still reasoning this step: no row (it samples freely)
            rows[rid] = num_rows
            outputs.append(so)
            drafts.append(d)
            num_rows += 1 + len(d)
        if outputs:
            plan.grammar_bitmask = self.manager.bitmask(outputs, drafts if num_rows > len(outputs) else None)
            plan.structured_output_request_ids = rows

    def pop_errors(self) -> list[tuple[str, str, Optional[str]]]:
        errors, self._errors = self._errors, []
        return errors

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown()
