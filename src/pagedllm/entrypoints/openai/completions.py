"""POST /v1/completions: text (or token-id) prompts in, text out; streaming as Server-Sent Events."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.body import parse_body, tokenize_work
from pagedllm.entrypoints.openai.errors import APIError, dumps
from pagedllm.entrypoints.openai.logprobs import (iter_logprobs, prompt_logprobs_json, safe_float, text_lengths,
                                                  token_label, token_str)
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.request_params import (build_sampling_params, check_context_length,
                                                        check_logprob_fields, check_token_ids, context_max_tokens,
                                                        data_parallel_rank, request_cache_salt, request_ids,
                                                        request_priority, truncate_prompt)
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.entrypoints.openai.streaming import (CachedTokens, ChunkFramer, SSEResponse, SSEStream, merge_streams,
                                                   start_disconnect_watch, usage_dict)

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


def echo_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0: the answer is the prompt alone (with its logprobs), nothing generated, as in OpenAI's
    legacy completions and vLLM (scoring a text). The engine still runs one step (its prompt logprobs come with the
    first token), whose token _without_generation drops."""
    return bool(req.echo) and req.max_tokens == 0 and not req.use_beam_search


def _without_generation(out: Any) -> Any:
    """The output of an echo-only choice: no text, tokens or logprobs; "length", as max_tokens 0 asked."""
    if out.finish_reason is None and not out.token_ids:
        return out
    return dataclasses.replace(out, text="", token_ids=[], logprobs=[] if out.logprobs is not None else None,
                               cumulative_logprob=None,
                               finish_reason="length" if out.finish_reason in ("stop", "length") else out.finish_reason,
                               stop_reason=None)


def parse_prompts(prompt: Any, tokenizer: Any, vocab_size: int, add_special_tokens: bool, field: str = "prompt"
                  ) -> list[tuple[Optional[str], list[int]]]:
    """-> [(text or None, token ids)] for str | [str] | [int] | [[int]] (`field`: the request field, for errors;
    /v1/embeddings' `input` takes the same shapes)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):  # the model's validation allows no mix of ints and others
        prompt = [prompt]
    if not prompt:
        raise APIError(f"'{field}' must not be empty.", param=field)
    out: list[tuple[Optional[str], list[int]]] = []
    for p in prompt:
        if isinstance(p, str):
            if p == "":
                raise APIError(f"'{field}' must not be an empty string.", param=field)
            out.append((p, list(tokenizer.encode(p, add_special_tokens=add_special_tokens))))
        else:
            ids = list(p)
            check_token_ids(ids, vocab_size, field)
            out.append((None, ids))
    return out


def _prompt_embeds(req: CompletionRequest, state: ServerState) -> list:
    """The request's prompt_embeds as tensors (vLLM's: one base64 string or a list of them); a 400 when the server
    was started without --enable-prompt-embeds, or for what needs the prompt's tokens."""
    if req.prompt_embeds is None:
        return []
    from pagedllm.prompt_embeds import PROMPT_EMBEDS_OFF, check_prompt_embeds
    from pagedllm.entrypoints.prompt_embeds import decode_prompt_embeds

    if not getattr(state.engine.engine_args, "enable_prompt_embeds", False):
        raise APIError(PROMPT_EMBEDS_OFF, param="prompt_embeds")
    for name, used in (("echo", req.echo), ("use_beam_search", req.use_beam_search),
                       ("prompt_logprobs", req.prompt_logprobs is not None)):
        if used:
            raise APIError(f"'{name}' with 'prompt_embeds' is not supported: it needs the prompt's tokens.",
                           param=name)
    items = [req.prompt_embeds] if isinstance(req.prompt_embeds, str) else list(req.prompt_embeds)
    try:
        # the model's hidden size and finite values checked here too, so the 400 names the field (the engine's
        # own check came back without it)
        return [check_prompt_embeds(decode_prompt_embeds(item), state.engine.ready.hidden_size) for item in items]
    except ValueError as e:
        raise APIError(str(e), param="prompt_embeds") from None


async def create_completion(request: Request, state: ServerState) -> Response:
    req = await parse_body(request, CompletionRequest)
    model = state.check_model(req.model)
    if req.return_tokens_as_token_ids is None:  # --return-tokens-as-token-ids: the server's default
        req.return_tokens_as_token_ids = state.return_tokens_as_token_ids
    salt = request_cache_salt(req)
    priority = request_priority(req, state.scheduling_policy)
    if req.suffix is not None:  # vLLM refuses any suffix, "" included
        raise APIError("suffix is not currently supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n and not req.use_beam_search:
        raise APIError("'best_of' other than n is only supported with use_beam_search.", param="best_of")
    engine = state.engine
    tok = state.tokenizer
    embeds = _prompt_embeds(req, state)
    from pagedllm.prompt_embeds import PROMPT_EMBEDS_PLACEHOLDER

    if req.prompt is None and not embeds:
        raise APIError("Missing required parameter: 'prompt' (or 'prompt_embeds').", param="prompt")
    # vLLM's order: the embeddings prompts first, then the text / token ones; an embeddings prompt carries as many
    # placeholder ids as it has rows (the engine puts the rows in their place).
    prompts = [(None, [PROMPT_EMBEDS_PLACEHOLDER] * len(e)) for e in embeds]
    if req.prompt is not None:
        prompts += await tokenize_work(request, parse_prompts, req.prompt, tok, engine.ready.vocab_size,
                                       req.add_special_tokens)
    if req.truncate_prompt_tokens is not None:  # a truncated prompt's text is its kept tokens' (decoded on echo)
        kept = [truncate_prompt(ids, req.truncate_prompt_tokens, state.max_model_len) for _, ids in prompts]
        prompts = [(text if len(k) == len(ids) else None, k) for (text, ids), k in zip(prompts, kept)]
        embeds = [e[len(e) - len(ids):] for e, (_, ids) in zip(embeds, prompts)]  # (their last rows kept)
    embeds_of = embeds + [None] * (len(prompts) - len(embeds))
    check_logprob_fields(req, state.max_logprobs, top_name="logprobs", top=req.logprobs,
                         vocab_size=engine.ready.vocab_size)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    request_id, engine_id = request_ids(request, "cmpl", req.request_id)
    if req.use_beam_search:
        from pagedllm.beam_search.driver import ClientDisconnected
        from pagedllm.entrypoints.openai import beam_search

        # a silent request: the generation config's max_new_tokens as the sampling path's (each search clamps it to
        # its prompt's room), else the endpoint's 16
        from_config = req.max_tokens is None and "max_tokens" in (state.sampling_defaults or {})
        beam_max = state.sampling_defaults["max_tokens"] if from_config else max_tokens
        for _, ids in prompts:
            check_context_length(len(ids), None if from_config else beam_max, state.max_model_len, "prompt")
        try:
            body = await beam_search.completion_response(req, state, model, request_id,
                                                         int(time.time()), prompts, beam_max, request.is_disconnected,
                                                         salt, priority, data_parallel_rank(request, engine))
        except ClientDisconnected:  # the client left mid-search: nobody reads an answer
            return Response(status_code=499)
        return Response(dumps(body), media_type="application/json")
    # echo + logprobs also scores the prompt tokens (OpenAI's legacy completions behaviour).
    echo_k = req.logprobs if req.echo and req.logprobs is not None else None
    prompt_k = max((k for k in (echo_k, req.prompt_logprobs) if k is not None), default=None)
    if req.prompt_logprobs == -1:  # the whole vocabulary: more than any echo's count
        prompt_k = -1
    params = build_sampling_params(req, 1 if echo_only(req) else req.max_tokens, req.logprobs, prompt_k,
                                   state.sampling_defaults, default_max_tokens=DEFAULT_MAX_TOKENS)
    limit = context_max_tokens(req.max_tokens, params, state.sampling_defaults)
    for _, ids in prompts:
        check_context_length(len(ids), limit, state.max_model_len, "prompt")
    sub_ids = [f"{engine_id}-{i}" for i in range(len(prompts))] if len(prompts) > 1 else [engine_id]
    stream = bool(req.stream)
    kind = "delta" if stream else "final_only"
    lora = state.lora_request(model)
    # A stream takes each engine step's output as it comes (batches: what arrived while it was writing).
    generate = engine.generate_batches if stream else engine.generate
    rank = data_parallel_rank(request, engine)
    gens = [generate(text, ids, params, sid, output_kind=kind, lora_request=lora, cache_salt=salt, priority=priority,
                     data_parallel_rank=rank, **({} if e is None else {"prompt_embeds": e}))
            for (text, ids), sid, e in zip(prompts, sub_ids, embeds_of)]
    watch = start_disconnect_watch(request, engine, sub_ids)
    # One prompt's stream is read as it is (one generator less per chunk); several are interleaved, as (i, item).
    merged = gens[0] if stream and len(gens) == 1 else merge_streams(gens)
    created = int(time.time())
    try:
        first = await merged.__anext__()
    except BaseException:
        watch.cancel()
        await merged.aclose()
        raise
    if stream:
        framer = ChunkFramer(request_id, "text_completion", created, model, req.stream_options,
                             state.force_include_usage)
        return SSEResponse(_CompletionStream(req, state, prompts, merged, first, watch, framer, engine_id))
    try:
        finals: dict[int, Any] = {first[0]: first[1]}
        async for i, out in merged:
            finals[i] = out
    finally:
        watch.cancel()
    return Response(dumps(_full_response(req, state, model, request_id, created, prompts, finals)),
                    media_type="application/json")


def _full_response(req: CompletionRequest, state: ServerState, model: str, request_id: str, created: int,
                   prompts: list, finals: dict[int, Any]) -> dict:
    tok = state.tokenizer
    choices = []
    num_prompt = num_gen = 0
    only_echo = echo_only(req)
    for i, (text, ids) in enumerate(prompts):
        final = finals[i]
        num_prompt += len(ids)
        prompt_text = text if text is not None else (final.prompt or tok.decode(ids))
        for out in sorted(final.outputs, key=lambda o: o.index):
            if only_echo:
                out = _without_generation(out)
            num_gen += len(out.token_ids)
            body = (prompt_text + out.text) if req.echo else out.text
            lp = None
            if req.logprobs is not None:
                offset0 = _prompt_span(tok, ids, final.prompt_logprobs) if req.echo else 0
                as_ids = bool(req.return_tokens_as_token_ids)
                lp = _completion_logprobs(tok, out.token_ids, out.logprobs, offset0, as_ids=as_ids)
                if req.echo:
                    lp = _merge_logprobs(_prompt_logprobs(tok, ids, final.prompt_logprobs, req.logprobs, as_ids), lp)
            choice = {"index": i * req.n + out.index, "text": body, "logprobs": lp,
                      "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(tok, final.prompt_logprobs)
            if req.return_token_ids:  # vLLM: both on the choice (each choice has its own prompt)
                choice["prompt_token_ids"] = list(ids)
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
    cached = CachedTokens(state.prompt_tokens_details)
    for i, final in finals.items():
        cached.note(i, final)
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_dict(num_prompt, num_gen, cached.total())}


def _prompt_logprobs(tok: Any, ids: list[int], prompt_logprobs: Optional[list], top_n: int,
                     as_ids: bool = False) -> dict:
    """The echoed prompt's part of the logprobs: the first token has no logprob (null), like OpenAI."""
    first = token_label(tok, ids[0], None, as_ids)
    head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    rest = _completion_logprobs(tok, ids[1:], (prompt_logprobs or [None] * len(ids))[1:],
                                len(token_str(tok, ids[0], None)), top_n, as_ids)
    return _merge_logprobs(head, rest)


def _prompt_span(tok: Any, ids: list[int], prompt_logprobs: Optional[list]) -> int:
    """Where an echoed prompt's generated tokens' text_offset starts: after the prompt tokens' own offsets, which
    count each token's text (a BOS token's, a "\ufffd" per piece of a split character) and so may pass the
    prompt text's length; starting at that length, offsets would step back (vLLM counts on, as here)."""
    entries = prompt_logprobs or [None] * len(ids)
    return sum(len(token_str(tok, t, e.get(t) if e else None)) for t, e in zip(ids, entries))


def _merge_logprobs(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


def _completion_logprobs(tok: Any, token_ids: list[int], logprobs: Optional[list], offset: int,
                         top_n: Optional[int] = None, as_ids: bool = False) -> dict:
    """top_n: keep the chosen token and the top_n (prompt logprobs may have been scored with more). `as_ids`:
    tokens as "token_id:<id>" (vLLM's return_tokens_as_token_ids); text_offset still counts the text."""
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    lengths = text_lengths(tok, list(token_ids), logprobs) if as_ids else None
    for k, (s, lp, tops) in enumerate(iter_logprobs(tok, list(token_ids), logprobs, as_ids)):
        result["tokens"].append(s)
        result["token_logprobs"].append(safe_float(lp))
        result["top_logprobs"].append({ts: safe_float(tl) for ts, tl, rank in tops
                                       if top_n is None or rank is None or rank <= top_n or ts == s})
        result["text_offset"].append(offset)
        offset += lengths[k] if lengths is not None else len(s)
    return result


class _CompletionStream(SSEStream):
    """The SSE chunks of a streamed completion; one prompt's items are batches of RequestOutputs, several
    prompts' are (prompt index, batch)."""

    def __init__(self, req: CompletionRequest, state: ServerState, prompts: list, batches: AsyncIterator,
                 first: Any, watch: Any, framer: ChunkFramer, engine_id: str) -> None:
        super().__init__(batches, first, watch, framer)
        self.req, self.tok, self.prompts = req, state.tokenizer, prompts
        self.multi = len(prompts) > 1
        self.echoed: set[int] = set()
        self.echo_pending: set[int] = set()  # echoed choices whose prompt logprobs are still to be sent
        self.offsets: dict[int, int] = {}
        self.num_gen = 0
        self.num_prompt = sum(len(ids) for _, ids in prompts)
        self.choice_gen = [0] * (len(prompts) * req.n)  # vLLM's continuous usage: the choice's prompt and tokens
        # A running choice of a plain stream (no logprobs, no echo, no token ids) is a template and its text.
        self.token_ids = bool(req.return_token_ids)
        self.ids_sent: set[int] = set()  # choices whose prompt_token_ids went out (vLLM: in the first chunk only)
        self.cached = CachedTokens(state.prompt_tokens_details)
        self.plain = (req.logprobs is None and not req.echo and not self.token_ids
                      and not (self.cached.enabled and framer.continuous_usage))  # (its template has no details)
        self.echo_only = echo_only(req)
        self.templates = [framer.template(b'{"index":%d,"text":' % index) for index in range(len(prompts) * req.n)]
        if self.plain and not self.multi and req.n == 1:
            self.direct = (state.engine, engine_id)

    def usage(self) -> dict:
        return usage_dict(self.num_prompt, self.num_gen, self.cached.total())

    def frames(self, item: Any) -> bytes:
        i, batch = item if self.multi else (0, item)
        if len(batch) == 1:
            return self.chunks(i, batch[0])
        return b"".join([self.chunks(i, ro) for ro in batch])

    def chunks(self, i: int, ro: Any) -> bytes:
        """The frames of one engine step's output (one per choice that has news)."""
        req, n = self.req, self.req.n
        frames = []
        self.cached.note(i, ro)
        for out in ro.outputs:
            if self.echo_only:
                out = _without_generation(out)
            index = i * n + out.index
            self.num_gen += len(out.token_ids)
            self.choice_gen[index] += len(out.token_ids)
            num_prompt = len(self.prompts[i][1])
            if self.plain and out.finish_reason is None:
                if out.text or out.token_ids:
                    before, after = self.templates[index]
                    frames.append(before + dumps(out.text) + after + self.framer.end(num_prompt,
                                                                                     self.choice_gen[index]))
                continue
            text = out.text
            if req.echo and index not in self.echoed:
                self.echoed.add(index)
                self.echo_pending.add(index)
                p_text, p_ids = self.prompts[i]
                text = (p_text if p_text is not None else self.tok.decode(p_ids)) + text
                if req.logprobs is not None:
                    self.offsets[index] = _prompt_span(self.tok, p_ids, ro.prompt_logprobs)
            if not text and out.finish_reason is None and not out.token_ids:
                continue
            lp = None
            if req.logprobs is not None:
                lp = self._logprobs(i, index, ro, out)
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason,
                      "stop_reason": out.stop_reason}
            if self.token_ids:
                if index not in self.ids_sent:
                    self.ids_sent.add(index)
                    choice["prompt_token_ids"] = list(self.prompts[i][1])
                choice["token_ids"] = list(out.token_ids)
            usage = None
            if self.framer.continuous_usage:
                usage = usage_dict(num_prompt, self.choice_gen[index], self.cached.of(i))
            frames.append(self.framer.choices([choice], usage))
        return frames[0] if len(frames) == 1 else b"".join(frames)

    def _logprobs(self, i: int, index: int, ro: Any, out: Any) -> dict:
        tok, offsets, as_ids = self.tok, self.offsets, bool(self.req.return_tokens_as_token_ids)
        lp = _completion_logprobs(tok, out.token_ids, out.logprobs, offsets.get(index, 0), as_ids=as_ids)
        offsets[index] = offsets.get(index, 0) + (sum(text_lengths(tok, out.token_ids, out.logprobs)) if as_ids
                                                  else sum(len(s) for s in lp["tokens"]))
        if index in self.echo_pending:
            self.echo_pending.discard(index)
            lp = _merge_logprobs(_prompt_logprobs(tok, self.prompts[i][1], ro.prompt_logprobs, self.req.logprobs,
                                                  as_ids), lp)
        return lp
