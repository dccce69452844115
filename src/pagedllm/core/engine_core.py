"""EngineCore: step() = schedule -> execute -> update. Used in-process by `LLM` and in its own process by
the API server (see entrypoints/engine_proc.py).

This module imports torch only through the model runner, which is built lazily in __init__; the scheduler,
block pool and request bookkeeping it drives are pure Python.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import numbers
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

from pagedllm.config import EngineArgs
from pagedllm.core.batch_plan import EngineCoreOutput
from pagedllm.core.block_hash import check_cache_salt
from pagedllm.core.errors import RequestStepError, check_sampled_tokens
from pagedllm.core.request import Request, RequestStatus, check_priority
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.structured_hooks import StructuredOutputHooks
from pagedllm.prompt_embeds import (PROMPT_EMBEDS_OFF, PROMPT_EMBEDS_PLACEHOLDER, check_prompt_embeds,
                                   prompt_embeds_key)
from pagedllm.sampling_constraints import check_against_engine
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.stats import SpecLogger

logger = logging.getLogger("pagedllm")


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: Optional[float] = None
    lora_id: Optional[int] = None
    cache_salt: Optional[str] = None
    priority: int = 0  # --scheduling-policy priority only (lower first)
    # vLLM's EmbedsPrompt (enable_prompt_embeds): a [num_tokens, hidden] tensor; prompt_token_ids then holds as many
    # placeholder ids (PROMPT_EMBEDS_PLACEHOLDER).
    prompt_embeds: Optional[Any] = None


def load_engine_tokenizer(engine_args: EngineArgs, model_dir: str) -> Any:
    """The tokenizer the frontend uses (engine_tokenizer_source), loaded once here for its EOS and handed to an
    in-process LLM; None with skip_tokenizer_init or where it does not load here (the frontend, which needs one,
    says why)."""
    if engine_args.skip_tokenizer_init:
        return None
    from pagedllm.tokenizer import engine_tokenizer_options, engine_tokenizer_source, get_tokenizer

    try:
        return get_tokenizer(engine_tokenizer_source(engine_args, model_dir), **engine_tokenizer_options(engine_args))
    except Exception:  # noqa: BLE001 - the frontend's own load reports it
        return None


def with_tokenizer_eos(eos_token_ids: list[int], tokenizer: Any) -> list[int]:
    """The model's end-of-sequence ids with the tokenizer's EOS first, as vLLM takes it (its requests' EOS; the
    config's and generation_config's stop as extras): a fine-tune whose tokenizer ends turns with another token
    than config.json's eos (ChatML's <|im_end|> over </s>) stops there. Unchanged without a tokenizer."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int) or isinstance(eos, bool) or eos < 0:
        return list(eos_token_ids)
    return [eos] + [t for t in eos_token_ids if t != eos]


class EngineCore:
    """Owns the scheduler and the model executor. Not thread-safe: one driver calls it."""

    def __init__(self, engine_args: Optional[EngineArgs] = None, **kwargs) -> None:
        from pagedllm.executor import make_executor  # heavy imports (torch, model) stay out of module import

        if engine_args is None:
            engine_args = EngineArgs.from_kwargs(**kwargs)
        engine_args.validate()
        if engine_args.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs several engine cores behind one `pagedllm serve`; an "
                             "offline LLM is one engine core (use tensor_parallel_size / pipeline_parallel_size, "
                             "or one LLM per device).")
        self.engine_args = engine_args
        self.closed = False
        start = time.perf_counter()
        # The Worker itself for one device (in-process), else a multi-process / Ray executor of ranks.
        self.worker = make_executor(engine_args)
        try:
            self._start(engine_args, start)
        except BaseException:
            self.shutdown()  # a failed start frees the device memory and worker processes it took
            raise

    def _start(self, engine_args: EngineArgs, start: float) -> None:
        w = self.worker
        self.model_dir = w.model_dir
        self.max_model_len = w.max_model_len
        self.vocab_size = w.vocab_size
        self.tokenizer = load_engine_tokenizer(engine_args, w.model_dir)
        self.eos_token_ids = with_tokenizer_eos(w.eos_token_ids, self.tokenizer)
        self.hidden_size = int(w.hf_config.hidden_size)  # an embedding's length (pooling/; the served text config)
        from pagedllm.pooling import embedding_only

        self.embedding_only = embedding_only(w.hf_config)  # a decoder stack without its head: no generation
        from pagedllm.pooling import check_runner_fits, classifier_labels, supported_tasks, token_classifier_labels

        # A sequence classifier's labels (None: not one): its pooled outputs are label logits, not embeddings.
        self.classifier_labels = classifier_labels(w.hf_config)
        self.token_labels = token_classifier_labels(w.hf_config)  # a token classifier's (per-token label logits)
        self.pad_token_id = getattr(w.hf_config, "pad_token_id", None)
        architectures = getattr(w.hf_config, "architectures", None) or [None]
        self.architecture = architectures[0]
        check_runner_fits(engine_args, self.classifier_labels, architectures[0], self.token_labels)
        # vLLM's pooling tasks the model answers: LLM.encode / POST /pooling choose among them
        self.pooling_tasks = supported_tasks(engine_args, self.classifier_labels, self.token_labels)
        from pagedllm.pooling import step_pooling

        # STEP pooling's settings (None: ALL) of a token-only engine; the entry points cut the rows (pooling.step_rows)
        self.step_pooling = step_pooling(self.architecture, engine_args.pooler_config) \
            if self.pooling_tasks == ("token_classify",) else None
        if self.step_pooling is not None:
            from pagedllm.pooling import check_step_columns

            check_step_columns(self.step_pooling["returned_token_ids"], len(self.token_labels or self.classifier_labels
                                                                            or ()) or self.hidden_size)
        self.block_size = engine_args.block_size
        self.num_blocks = w.num_blocks
        self.scheduler = Scheduler(
            max_num_seqs=w.max_num_seqs,
            max_num_batched_tokens=w.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            enable_prefix_caching=engine_args.enable_prefix_caching,
            async_scheduling=w.async_scheduling,
            enable_chunked_prefill=engine_args.enable_chunked_prefill,
            num_speculative_tokens=w.num_speculative_tokens,
            spec_disable_batch_size=w.spec_disable_batch_size,
            max_loras=engine_args.max_loras if engine_args.enable_lora else None,
            kv_group_windows=getattr(w, "kv_group_windows", (None,)),
            ntk_original=getattr(w, "ntk_original", None),
            long_rope_original=getattr(w, "long_rope_original", None),
            scheduling_policy=engine_args.scheduling_policy,
            long_prefill_token_threshold=engine_args.long_prefill_token_threshold,
        )
        self.loras = EngineLoRAs(w.lora_manager, self.scheduler)
        from pagedllm import envs

        if not str(getattr(w, "device", "cuda")).startswith("cpu") and not envs.PAGEDLLM_PARTIAL_BLOCK_COPIES:
            # PAGEDLLM_PARTIAL_BLOCK_COPIES=0: beam forks recompute the last partial block (A/B).
            self.scheduler.kv_cache_manager.disable_partial_blocks()
        # The periodic acceptance line is a stats log: off with disable_log_stats (the offline LLM's default, as
        # vLLM's; `serve` logs unless --disable-log-stats). /metrics counts either way.
        self._spec_log = (SpecLogger(self.scheduler.spec_stats)
                          if w.num_speculative_tokens and not engine_args.disable_log_stats else None)
        if w.speculative is not None:
            sc = w.speculative
            logger.info("Speculative decoding: %s%s, %d tokens per step, off in steps with more than %s running + "
                        "waiting requests%s.", sc.method,
                        f" ({sc.model})" if sc.model else f" (lookup {sc.prompt_lookup_min}..{sc.prompt_lookup_max})",
                        sc.num_speculative_tokens, sc.disable_by_batch_size,
                        "" if self._spec_log is None
                        else f"; acceptance is logged every {self._spec_log.interval_s:.0f} s")
        self.async_scheduling = w.async_scheduling
        self.scheduler.spec.overlap = bool(getattr(w, "spec_overlap", False))
        # Structured outputs: built on the first request under a grammar (engines without any pay nothing).
        self.structured = StructuredOutputHooks(self, engine_args)
        # Async scheduling fills grammar masks while the step's forward runs, where the worker supports it.
        self._overlap_masks = bool(getattr(self.worker, "launch_hook", False))
        if not engine_args.enable_chunked_prefill:
            logger.info("Chunked prefill is off: each prompt runs whole in one step (up to %d tokens per step).",
                        w.max_num_batched_tokens)
        # Async scheduling: the launched step whose results have not been applied yet.
        self._in_flight = None  # (plan, PendingOutput)
        # Pipeline parallel: up to one micro-batch per stage in flight, oldest first.
        self.num_micro_batches = engine_args.pipeline_parallel_size
        self._micro_batches: deque = deque()
        self.failure: Optional[Exception] = None
        self.num_steps = 0
        self.sleeping_tags: set[str] = set()  # sleep mode: what is given back now ("weights", "kv_cache")
        self.sleep_level = 0  # the level of the last sleep (what the weights went through)
        self._step_plans: list = []  # the plans the current step works on (for recovery from a failed step)
        windows = self.scheduler.kv_cache_manager.group_windows
        if any(w is not None for w in windows):
            logger.info("Sliding-window KV cache: %d block table(s) per request, windows %s (blocks before a "
                        "window are freed).", len(windows), ", ".join("full" if w is None else str(w)
                                                                      for w in windows))
        logger.info("Engine ready in %.1f s: %d KV blocks of %d tokens = %d tokens of KV cache "
                    "(%.1fx max_model_len %d).", time.perf_counter() - start, self.num_blocks, self.block_size,
                    self.scheduler.num_pool_tokens, self.scheduler.num_pool_tokens / self.max_model_len,
                    self.max_model_len)

    def cache_config_info(self) -> dict[str, str]:
        """The KV cache's configuration under vLLM's CacheConfig field names, values as str() gives them (what
        vLLM's vllm:cache_config_info shows in its labels); the fields pagedllm has."""
        a = self.engine_args
        info = {
            "block_size": self.block_size, "cache_dtype": a.kv_cache_dtype,
            "gpu_memory_utilization": a.gpu_memory_utilization, "kv_cache_memory_bytes": a.kv_cache_memory_bytes,
            "num_gpu_blocks": self.num_blocks, "num_gpu_blocks_override": a.num_gpu_blocks_override,
            "enable_prefix_caching": self.scheduler.kv_cache_manager.enable_caching,
            "prefix_caching_hash_algo": "sha256",  # core/block_hash.py
            "cpu_offload_gb": a.cpu_offload_gb,
        }
        return {k: str(v) for k, v in info.items()}

    def set_tokenizer(self, tokenizer: Any) -> None:
        """The offline LLM's set_tokenizer: later requests stop at the new tokenizer's EOS (first, as at start) and
        grammars compile against its vocabulary. Only between calls (no request in flight)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = with_tokenizer_eos(self.worker.eos_token_ids, tokenizer)
        self.structured.set_tokenizer(tokenizer)

    @functools.cached_property
    def pooling_defaults(self) -> Any:
        """The model's embedding pooling (pooling.model_pooling): read on the first embedding request."""
        from pagedllm.pooling import model_pooling

        args = self.engine_args
        return model_pooling(self.model_dir, args.pooler_config, args.hf_overrides, args.hf_config_dir())

    # ------------------------------------------------------------------ requests
    def add_request(self, req: EngineCoreRequest) -> None:
        """Validate and queue a request. Raises ValueError (a user error) before anything is queued."""
        if self.closed:
            raise EngineShutDown()
        if self.sleeping_tags:
            raise EngineSleeping()
        if req.request_id in self.scheduler.requests:
            # Refused before anything keyed by the id is touched: a grammar submitted for the duplicate took the
            # running request's place in the structured-output hooks, which then dropped its mask (it went off its
            # grammar and was aborted).
            raise ValueError(f"Request id {req.request_id!r} is already in use.")
        embeds = req.prompt_embeds
        if embeds is not None:
            if not self.engine_args.enable_prompt_embeds:
                raise ValueError(PROMPT_EMBEDS_OFF)
            embeds = check_prompt_embeds(embeds, self.hidden_size)
            if req.sampling_params.pooling is not None or req.sampling_params.prompt_logprobs is not None:
                raise ValueError("prompt_embeds prompts generate only: prompt_logprobs and pooling need the prompt's "
                                 "token ids.")
            req.prompt_token_ids = [PROMPT_EMBEDS_PLACEHOLDER] * embeds.shape[0]
        prompt = list(req.prompt_token_ids)
        num_prompt = len(prompt)
        if num_prompt == 0:
            raise ValueError("The prompt is empty: give at least one token.")
        vocab = self.vocab_size
        if any(type(t) is not int or t < 0 or t >= vocab for t in prompt):  # (no bools: True is no token id)
            bad = next(t for t in prompt if type(t) is not int or not 0 <= t < vocab)
            raise ValueError(f"Prompt token ids must be integers in [0, {vocab}), got {bad!r}.")
        kind = req.sampling_params.pooling
        if kind is not None:
            from pagedllm.pooling import check_request_pooling

            check_request_pooling(kind, self.pooling_tasks, self.architecture)
        elif self.pooling_tasks == ("token_classify",):
            from pagedllm.pooling import token_only_refusal

            raise ValueError(token_only_refusal(self.architecture, self.token_labels is not None, "generation"))
        if self.classifier_labels is not None and req.sampling_params.pooling is None:
            raise ValueError(f"This model ({self.embedding_only}) is a sequence classifier: it serves classification "
                             "and scoring (LLM.classify / LLM.score, POST /classify, /score, /rerank), not "
                             "generation.")
        if self.embedding_only and req.sampling_params.pooling is None:
            raise ValueError(f"This model ({self.embedding_only}) is a decoder without its language-model head: it "
                             "serves embeddings (LLM.embed, POST /v1/embeddings), not generation.")
        if self.engine_args.embeddings_only and req.sampling_params.pooling is None:
            raise ValueError("This engine runs the model for embeddings only (runner 'pooling', --runner pooling): "
                             "use LLM.embed / POST /v1/embeddings, or start it without that to generate.")
        if num_prompt >= self.max_model_len and req.sampling_params.pooling is not None:
            what = "a per-token pooling" if kind == "all" else "a classification" \
                if self.classifier_labels is not None else "an embedding"  # (LLM.classify's)
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your input has "
                f"{num_prompt} tokens; {what} input may have at most {self.max_model_len - 1}. Please shorten "
                "the input.")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{num_prompt} tokens, which leaves no room for any output. Please shorten the prompt.")
        if num_prompt > self.scheduler.max_request_tokens:
            raise ValueError(
                f"The prompt has {num_prompt} tokens but the KV cache holds only {self.scheduler.max_request_tokens} "
                "tokens of one request; raise --gpu-memory-utilization / kv cache memory or shorten the prompt.")
        self.loras.check_request(req.lora_id)
        check_cache_salt(req.cache_salt)
        check_priority(req.priority, self.engine_args.scheduling_policy)
        params = req.sampling_params
        check_against_engine(params, self.vocab_size, self.engine_args.max_logprobs)
        room = self.max_model_len - num_prompt
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.min_tokens > max_tokens:  # before the clamp below, whose own check would name a value never given
            asked = "max_tokens unset" if params.max_tokens is None else f"max_tokens={params.max_tokens}"
            raise ValueError(
                f"min_tokens={params.min_tokens} cannot be met: the prompt's {num_prompt} tokens leave room for "
                f"{room} in this model's context of {self.max_model_len} tokens ({asked} is clamped to that "
                "room). Ask for fewer min_tokens or shorten the prompt.")
        changes = {"max_tokens": max_tokens} if params.max_tokens != max_tokens else {}
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) == -1:  # the whole vocabulary (vLLM): the worker takes a count
                changes[name] = self.vocab_size
        if changes or self.eos_token_ids[1:]:
            params = params.clone(**changes)
            # Extra end-of-turn ids (generation_config) stop like EOS (unless ignore_eos).
            if not params.ignore_eos:
                params.all_stop_token_ids = set(params.all_stop_token_ids) | set(self.eos_token_ids[1:])
        request = Request(
            request_id=req.request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            arrival_time=req.arrival_time if req.arrival_time is not None else time.monotonic(),
            lora_id=req.lora_id,
            lora_cache_key=self.loras.cache_key(req.lora_id),
            cache_salt=req.cache_salt,
            priority=req.priority,
            prompt_embeds=embeds,
            embeds_key=None if embeds is None else prompt_embeds_key(embeds),
        )
        if params.structured_outputs is not None:
            request.structured_output = self.structured.submit(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        if not self.closed:  # a shut-down engine has no requests left to abort
            request_ids = list(request_ids)
            self.structured.release(request_ids)
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return not self.closed and (self._in_flight is not None or bool(self._micro_batches)
                                    or self.scheduler.has_unfinished_requests())

    # ------------------------------------------------------------------ the loop body
    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request) -> bool:
        """Register an adapter (read and validated now; LoRAError, a ValueError, if it cannot be served)."""
        from pagedllm.lora.resolve import with_local_path  # a hub id -> its cached snapshot (no-op for a dir)

        return self.loras.add(with_local_path(lora_request))

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter; requests already using it finish first. False if it was not registered."""
        return self.loras.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.loras.ids()

    def step(self) -> list[EngineCoreOutput]:
        """One engine step. A RequestStepError (one request's fault) leaves the engine consistent: the failed
        requests are finished (aborted), every other request of the step's plans is preempted and recomputed,
        and the error is re-raised for the driver to report; the next step runs as usual. Any other exception
        (a dead or hung worker rank) leaves the engine failed: every later step raises it again."""
        if self.closed:
            raise EngineShutDown()
        if self.failure is not None:
            raise self.failure
        self._step_plans = []
        self._step_outputs: list[EngineCoreOutput] = []
        if self.loras.pending_removal:
            self.loras.collect()
        if self._spec_log is not None:
            self._spec_log.maybe_log()
        try:
            if self.num_micro_batches > 1:
                return self._step_pipelined()
            sched = self.scheduler
            if (self.async_scheduling and sched.spec_active() and not sched.spec_overlap_active()
                    and sched.spec.wants_sync(sched.running)):
                # A speculating step needs the drafts its previous step proposed: finish that step first (only
                # while the proposer finds drafts: otherwise plain steps keep overlapping).
                return self._apply_in_flight() + self._step_sync()
            return self._step_async() if self.async_scheduling else self._step_sync()
        except RequestStepError as e:
            self._recover_failed_step(e)
            raise
        except Exception as e:
            self.failure = e
            raise

    def _step_sync(self) -> list[EngineCoreOutput]:
        self.structured.before_schedule()
        plan = self.scheduler.schedule()
        if plan.total_num_scheduled_tokens == 0 and not plan.finished_request_ids:
            self.structured.idle_wait()
            return self.scheduler.update_from_output(plan, self.worker.empty_output())
        self._step_plans.append(plan)
        self.structured.attach_bitmask(plan)
        output = self.worker.execute_model(plan)
        self.num_steps += 1
        return self._update(plan, output)

    def _update(self, plan, output) -> list[EngineCoreOutput]:
        check_sampled_tokens(output.req_ids, output.sampled_token_ids, self.vocab_size)
        outputs = self.scheduler.update_from_output(plan, output)
        self._step_outputs += outputs  # already applied: a later failure in this step must still deliver them
        return outputs

    def _recover_failed_step(self, e: RequestStepError) -> None:
        failed = set(e.request_ids)
        others = {rid for plan in self._step_plans for rid in plan.num_scheduled_tokens} - failed
        e.outputs = [o for o in self._step_outputs if o.request_id not in failed]
        self._in_flight = None  # its results are void: its requests are recomputed
        self._micro_batches.clear()
        self.scheduler.finish_requests(list(failed), RequestStatus.FINISHED_ABORTED)
        self.scheduler.preempt_requests(others)
        # A request that asked for the impossible (a 400: no token satisfies its constraints) is the client's
        # doing, not an engine fault: a warning, as other refused requests.
        logger.log(logging.WARNING if e.status < 500 else logging.ERROR,
                   "step failed for %d request(s) (%s): %s; %d other request(s) of the step are recomputed",
                   len(failed), ", ".join(sorted(failed)[:4]), e.message, len(others))

    def _step_async(self) -> list[EngineCoreOutput]:
        """Schedule and launch step N, then apply step N-1's results while N runs on the device.

        The host work of one step (applying results, scheduling, building inputs) overlaps the device work
        of the next. Requests whose sampling needs every earlier token (seeds, penalties, min_tokens) make
        the step wait for the previous one first.
        """
        outputs: list[EngineCoreOutput] = []
        self.structured.before_schedule()
        plan = self.scheduler.schedule()
        if self._in_flight is not None and self._plan_needs_sync(plan):
            outputs = self._apply_in_flight()
        if plan.total_num_scheduled_tokens == 0:
            outputs += self._apply_in_flight()
            self.worker.launch(plan)  # nothing to run; the runner still drops finished requests' state
            if not outputs:
                self.structured.idle_wait()
            return outputs + self.scheduler.update_from_output(plan, self.worker.empty_output())
        self._step_plans.append(plan)
        if self._in_flight is not None and self._overlap_masks and self.structured.plan_has_grammar(plan):
            return outputs + self._launch_with_mask_overlap(plan)
        # No step in flight (or it was applied above): the matchers are current.
        self.structured.attach_bitmask(plan)
        pending = self.worker.launch(plan)
        self.num_steps += 1
        outputs += self._apply_in_flight()
        self._in_flight = (plan, pending)
        return outputs

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Pipeline parallel: keep one micro-batch per stage in flight, then apply the oldest one's results.

        Each schedule() advances the computed-token counts of what it plans, so the next call plans other work:
        requests waiting for their in-flight token are caught up and skipped; a prefill's next chunk may go in
        the next micro-batch (every stage runs micro-batches in order, so its KV is written before it is read,
        also for blocks that a preemption or abort handed to another request meanwhile).
        """
        outputs: list[EngineCoreOutput] = []
        sched = self.scheduler
        # Spread the requests over the stages: each micro-batch takes its share of them.
        share = max(1, -(-(sched.num_running + sched.num_waiting) // self.num_micro_batches))
        self.structured.before_schedule()
        while len(self._micro_batches) < self.num_micro_batches:
            plan = sched.schedule(max_num_reqs=share)
            if plan.total_num_scheduled_tokens == 0:
                if plan.finished_request_ids:
                    self.worker.launch(plan)  # the ranks still drop those requests' state
                if not self._micro_batches and not outputs:
                    self.structured.idle_wait()
                outputs += self.scheduler.update_from_output(plan, self.worker.empty_output())
                break
            # A request is in at most one micro-batch in flight, so its matcher has seen every earlier token.
            self.structured.attach_bitmask(plan)
            self._micro_batches.append((plan, self.worker.launch(plan)))
            self.num_steps += 1
        self._step_plans.extend(p for p, _ in self._micro_batches)
        if self._micro_batches:
            plan, pending = self._micro_batches.popleft()
            outputs += self._update(plan, pending.result())
        return outputs

    def _launch_with_mask_overlap(self, plan) -> list[EngineCoreOutput]:
        """Launch a step whose masked requests still wait for the step in flight: the runner enqueues the forward,
        then (while the device runs it) we apply the previous step's tokens, advancing the matchers, and fill the
        bitmask; then it enqueues the masked sampling."""
        applied: list[EngineCoreOutput] = []

        def before_sampling() -> None:
            applied.extend(self._apply_in_flight())
            self.structured.attach_bitmask(plan)

        pending = self.worker.launch(plan, before_sampling=before_sampling)
        self.num_steps += 1
        if self._in_flight is not None:  # the runner sampled nothing and skipped the hook
            applied.extend(self._apply_in_flight())
        self._in_flight = (plan, pending)
        return applied

    def _apply_in_flight(self) -> list[EngineCoreOutput]:
        if self._in_flight is None:
            return []
        plan, pending = self._in_flight
        self._step_plans.append(plan)
        self._in_flight = None
        return self._update(plan, pending.result())

    def _plan_needs_sync(self, plan) -> bool:
        sched = self.scheduler
        if not (sched.num_needs_sync_sampling if self._overlap_masks else sched.num_needs_sync):
            return False  # no unfinished request needs it (the usual case: no pass over the plan)
        requests = sched.requests
        attr = "needs_sync_sampling" if self._overlap_masks else "needs_sync"
        return any(getattr(requests[r], attr) for r in plan.num_scheduled_tokens if r in requests)

    def get_stats(self):
        stats = self.scheduler.stats()
        stats.sleep_state = self.sleep_state
        return stats

    @property
    def sleep_state(self) -> str:
        """vLLM's vllm:engine_sleep_state: "awake" (nothing asleep), "weights_offloaded" / "discard_all" (the weights
        asleep after sleep level 1 / 2), or "kv_cache_asleep" (the weights woken before the KV cache)."""
        if not self.sleeping_tags:
            return "awake"
        if "weights" not in self.sleeping_tags:
            return "kv_cache_asleep"
        return "weights_offloaded" if self.sleep_level == 1 else "discard_all"

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    # ------------------------------------------------------------------ sleep mode (vLLM's)
    def sleep(self, level: int = 1) -> None:
        """Give the device memory back while idle: the KV cache is freed (its contents and the prefix cache are
        forgotten); level 1 moves the weights to host memory, level 2 discards them (wake_up reloads them from the
        model's files). Refused while requests are unfinished: their KV cache would be lost."""
        if self.closed:
            raise EngineShutDown()
        if not self.engine_args.enable_sleep_mode:
            raise ValueError("Sleep mode is off: start the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode) to use sleep / wake_up.")
        if isinstance(level, bool) or not isinstance(level, numbers.Integral) or level not in (1, 2):
            raise ValueError(f"The sleep level must be 1 (weights to host memory) or 2 (weights discarded), "
                             f"got {level!r}.")
        if self.sleeping_tags:
            logger.warning("The engine is already sleeping; sleep(level=%s) does nothing.", level)
            return
        self._require_idle("sleep", "their KV cache would be lost")
        if not self.scheduler.reset_prefix_cache():  # no request holds a block: this cannot fail
            raise RuntimeError("The prefix cache could not be reset before sleeping; this is a bug.")
        start = time.perf_counter()
        self.worker.sleep(level)
        self.sleeping_tags = {"weights", "kv_cache"}
        self.sleep_level = int(level)
        logger.info("Sleeping (level %d) after %.2f s: the KV cache is freed, the weights are %s.", level,
                    time.perf_counter() - start, "in host memory" if level == 1 else "discarded")

    def _require_idle(self, what: str, why: str) -> None:
        """EngineBusy unless no request is unfinished, once the steps launched for finished ones are applied."""
        if not self.scheduler.has_unfinished_requests():
            self._finish_launched_steps()
        if self.has_unfinished_requests():
            raise EngineBusy(f"Cannot {what} with {self.scheduler.num_running + self.scheduler.num_waiting} "
                             f"unfinished request(s): {why}. Wait for them or abort them first.")

    def _finish_launched_steps(self) -> None:
        """Async scheduling / pipeline stages: a step launched before its requests finished may still be in
        flight (the server's client already has its last token); its results name only finished requests."""
        self._apply_in_flight()
        while self._micro_batches:
            plan, pending = self._micro_batches.popleft()
            self._update(plan, pending.result())

    def wake_up(self, tags: Optional[Iterable[str]] = None) -> None:
        """Bring back what sleep gave away: `tags` "weights" and / or "kv_cache" (None: both). Requests are
        taken again once both are back."""
        if self.closed:
            raise EngineShutDown()
        wanted = set(SLEEP_TAGS if tags is None else [tags] if isinstance(tags, str) else tags)
        unknown = wanted - set(SLEEP_TAGS)
        if unknown or not wanted:
            raise ValueError(f"wake_up tags must be among {', '.join(SLEEP_TAGS)}, got {sorted(unknown) or '[]'}.")
        if not self.sleeping_tags:
            logger.warning("The engine is not sleeping; wake_up does nothing.")
            return
        start = time.perf_counter()
        todo = [t for t in SLEEP_TAGS if t in wanted and t in self.sleeping_tags]
        self.worker.wake_up(todo)
        self.sleeping_tags -= set(todo)
        logger.info("Woke up %s in %.2f s%s.", " and ".join(todo), time.perf_counter() - start,
                    "" if not self.sleeping_tags else f" ({', '.join(sorted(self.sleeping_tags))} still asleep)")

    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """A worker method (by name) run on every rank; their answers in rank order."""
        if self.closed:
            raise EngineShutDown()
        if method in ("sleep", "wake_up"):  # the engine's own state must follow: its methods, not the ranks'
            raise ValueError(f"Call LLM.{method}() rather than collective_rpc({method!r}).")
        if method != "reload_weights":
            return self.worker.collective_rpc(method, tuple(args), kwargs)
        # New weights (an RL trainer's update): no running request may see both, nor a cached prefix the old ones
        # computed.
        self._require_idle("reload the weights", "they would see both the old and the new weights")
        answers = self.worker.collective_rpc(method, tuple(args), kwargs)
        self.scheduler.reset_prefix_cache()
        return answers

    def check_health(self) -> None:
        """Raise if a worker rank is gone (the idle server loop asks once a second)."""
        check = getattr(self.worker, "check_health", None)
        if check is not None:
            check()

    def pop_request_errors(self) -> list[tuple[str, str, Optional[str]]]:
        """(request id, message, the request field it is about or None) of requests refused after add_request (a
        grammar that failed to compile)."""
        return self.structured.pop_errors()

    def shutdown(self) -> None:
        """Stop the engine and let go of everything it holds: the grammar compile thread, the worker (KV cache,
        CUDA graphs, weights; worker processes exit) and the scheduler's state. Idempotent; step() and
        add_request() raise EngineShutDown afterwards."""
        if self.closed:
            return
        self.closed = True
        # The step in flight holds the runner (and its device tensors): dropped before the worker frees them.
        self._in_flight = None
        self._micro_batches = deque()
        self._step_plans = []
        self.failure = None  # its traceback's frames may hold the runner's tensors
        structured = self.__dict__.pop("structured", None)
        try:
            if structured is not None:
                structured.shutdown()
        finally:
            # The adapter registry holds the worker's LoRA manager (and through it the model's layers).
            self.__dict__.pop("loras", None)
            self.__dict__.pop("scheduler", None)
            self.__dict__.pop("_spec_log", None)
            worker, self.worker = self.worker, None
            if worker is not None:
                worker.shutdown()


SLEEP_TAGS = ("weights", "kv_cache")


class EngineBusy(ValueError):
    """sleep() with unfinished requests (the server answers 409)."""


class EngineSleeping(ValueError):
    """A request reached a sleeping engine (sleep mode): the server answers 503."""

    def __init__(self) -> None:
        super().__init__("The engine is sleeping (sleep mode): wake it up first (LLM.wake_up() / POST /wake_up).")


class EngineShutDown(RuntimeError):
    """The engine was shut down: it runs no more requests."""

    def __init__(self) -> None:
        super().__init__("This engine was shut down; create a new one to run more requests.")


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (model, caches, tokenizer, modules) out of the cyclic collector's
    view: steps allocate thousands of small objects, and each full collection they trigger would otherwise walk
    all of it, a pause that grows with the heap (docs/benchmarks.md, host work per step).

    For the processes pagedllm owns (the server's engine-core and API processes, which live as long as their
    engine): frozen objects are never collected again, so a process that builds engines one after another (an
    offline `LLM`) uses `objects_frozen` around its loop instead."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def objects_frozen() -> Iterator[None]:
    """The same while the block runs (an offline generate loop), then everything is unfrozen: the steps get
    the short collections, and a deleted engine is collected as usual. Where something is frozen already (the
    caller manages freezing itself), leaves it alone."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()  # no collection first (a full pass per call): garbage already there waits for the end
    try:
        yield
    finally:
        gc.unfreeze()


class EngineLoRAs:
    """The engine's adapter registry (id -> LoRARequest) over the worker's LoRAManager (None: LoRA off)."""

    def __init__(self, manager, scheduler: Scheduler) -> None:
        self.manager = manager
        self.scheduler = scheduler
        self.requests: dict[int, object] = {}
        self.pending_removal: set[int] = set()
        # id -> (path, prefix-cache key) of its last load, kept after removal: an id loaded again with another
        # path gets a fresh key (negative: never a real id), else its old blocks would serve the new weights.
        self._cache_keys: dict[int, tuple[str, int]] = {}
        self._fresh_keys = itertools.count(-1, -1)

    def _enabled(self) -> None:
        if self.manager is None:
            raise ValueError("LoRA adapters need the engine started with enable_lora=True (--enable-lora).")

    def check_request(self, lora_id: Optional[int]) -> None:
        if lora_id is None:
            return
        self._enabled()
        if lora_id not in self.requests or lora_id in self.pending_removal:
            raise ValueError(f"LoRA adapter id {lora_id} is not loaded; add it first (LLM.generate(lora_request=...)"
                             " or POST /v1/load_lora_adapter).")

    def add(self, lora_request) -> bool:
        self._enabled()
        lora_id = lora_request.lora_int_id
        known = self.requests.get(lora_id)
        inplace = bool(getattr(lora_request, "load_inplace", False))
        if known is not None and known.lora_path == lora_request.lora_path and not inplace:
            if lora_id not in self.pending_removal:
                return False
            # Removed while its requests still run, and added again as it was: still loaded, so the removal is
            # called off (it was refused as if given another path).
            self.pending_removal.discard(lora_id)
            self.requests[lora_id] = lora_request
            return True
        if known is not None and self._in_use(lora_id):
            what = "reloaded in place" if inplace else "given another path"
            raise ValueError(f"LoRA adapter id {lora_id} is in use by running requests and cannot be {what}; give "
                             "the new adapter a different lora_int_id.")
        if inplace and known is not None:
            self._drop(lora_id)  # the manager keeps a host copy per id and path: read the files again
        self.manager.add_lora(lora_id, lora_request.lora_name, lora_request.lora_path)
        self.requests[lora_id] = lora_request
        last = self._cache_keys.get(lora_id)
        if last is None or last[0] != lora_request.lora_path or inplace:
            self._cache_keys[lora_id] = (lora_request.lora_path, lora_id if last is None else next(self._fresh_keys))
        self.pending_removal.discard(lora_id)
        return True

    def remove(self, lora_id: int) -> bool:
        if lora_id not in self.requests or lora_id in self.pending_removal:
            return False
        if self._in_use(lora_id):
            self.pending_removal.add(lora_id)  # dropped once its requests are done (collect)
        else:
            self._drop(lora_id)
        return True

    def ids(self) -> set[int]:
        return set(self.requests) - self.pending_removal

    def cache_key(self, lora_id: Optional[int]) -> Optional[int]:
        entry = None if lora_id is None else self._cache_keys.get(lora_id)
        return None if entry is None or entry[1] == lora_id else entry[1]

    def id_of_name(self, name: str) -> Optional[int]:
        """The id of the registered adapter called `name` (None: none is)."""
        for lora_id, request in self.requests.items():
            if lora_id not in self.pending_removal and getattr(request, "lora_name", None) == name:
                return lora_id
        return None

    def collect(self) -> None:
        in_use = {r.lora_id for r in self.scheduler.requests.values()}
        for lora_id in list(self.pending_removal):
            if lora_id not in in_use:
                self._drop(lora_id)

    def _in_use(self, lora_id: int) -> bool:
        return any(r.lora_id == lora_id for r in self.scheduler.requests.values())

    def _drop(self, lora_id: int) -> None:
        self.pending_removal.discard(lora_id)
        self.requests.pop(lora_id, None)
        self.manager.remove_lora(lora_id)
