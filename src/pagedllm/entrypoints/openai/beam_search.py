"""`use_beam_search: true` on /v1/completions and /v1/chat/completions (vLLM's extension).

The beam width is best_of when given, else n; the best n beams come back as the n choices. Sampling fields that
beam search cannot honour (temperature, top_p, penalties, stop strings, logprobs, streaming) are refused with a
400 rather than ignored.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Optional

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.request_params import _param_of
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.sampling_params import BeamSearchParams

# field -> values that mean "not used"; anything else cannot be honoured by beam search.
_UNUSED = {"temperature": (None, 0, 0.0), "top_p": (None, 1, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0, 0.0),
           "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
           "repetition_penalty": (None, 1, 1.0), "stop": (None, [], ""), "stop_token_ids": (None, []),
           "min_tokens": (0, None), "stream": (None, False), "echo": (None, False), "logprobs": (None, False),
           "logit_bias": (None, {}), "bad_words": (None, []), "allowed_token_ids": (None, []),
           "prompt_logprobs": (None,), "top_logprobs": (None,),
           # the output's format and its decoding: beam search neither constrains nor parses its beams
           "response_format": (None, {"type": "text"}), "structured_outputs": (None,), "guided_json": (None,),
           "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
           "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,), "tools": (None, []),
           "tool_choice": (None, "none"), "skip_special_tokens": (None, True),
           "spaces_between_special_tokens": (None, True)}


def beam_search_params(req: Any, max_tokens: int) -> tuple[BeamSearchParams, int]:
    """(BeamSearchParams, n) from the request, or a 400 naming the field."""
    n, best_of = req.n, getattr(req, "best_of", None)
    if not isinstance(n, int) or n < 1:
        raise APIError(f"n must be an integer >= 1 with use_beam_search, got {n!r}.", param="n")
    if best_of is not None and best_of < n:
        raise APIError(f"best_of ({best_of}) must be >= n ({n}) with use_beam_search: the beam width is best_of "
                         "and the best n beams are returned.", param="best_of")
    width = best_of if best_of is not None else n
    if width > 64:
        raise APIError(f"The beam width (best_of or n) must be <= 64, got {width}.",
                       param="best_of" if best_of is not None else "n")
    for name, unused in _UNUSED.items():
        value = getattr(req, name, None)
        if value not in unused:
            raise APIError(f"'{name}' cannot be used with use_beam_search (beam search ranks beams by the model's "
                             f"own log-probabilities and returns complete beams).", param=name)
    try:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=bool(req.ignore_eos),
                                  length_penalty=req.length_penalty, early_stopping=req.early_stopping,
                                  include_stop_str_in_output=bool(req.include_stop_str_in_output))
    except ValueError as e:  # (the 400 names the field, as the sampling path's does)
        raise APIError(str(e), param=_param_of(str(e))) from None
    return params, n


async def search(state: ServerState, prompt_ids: list[int], params: BeamSearchParams, disconnected=None,
                 lora_request: Any = None, cache_salt: Optional[str] = None, priority: int = 0,
                 data_parallel_rank: Optional[int] = None, width_param: str = "n"):
    """One prompt's search; every beam step runs under the request's adapter, prefix-cache salt and priority (and
    on its X-data-parallel-rank core). width_param: the field that set the beam width (a 400 names it)."""
    from pagedllm.beam_search.driver import run_async

    engine = state.engine
    # a default max_tokens (the generation config's) may pass the prompt's room: the search stops at the context's end
    room = max(1, state.max_model_len - len(prompt_ids))
    params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))

    async def one(seq: list[int], sp) -> Any:
        final = None
        async for out in engine.generate(None, seq, sp, output_kind="final_only", lora_request=lora_request,
                                         cache_salt=cache_salt, priority=priority,
                                         data_parallel_rank=data_parallel_rank):
            final = out
        return final

    tok = state.tokenizer
    from pagedllm.beam_search.search import BeamSearch, check_logprobs_mode

    eos = list(engine.ready.eos_token_ids)
    vocab_size = engine.ready.vocab_size
    try:  # the beam width needs the top 2 x width logprobs per step: within --max-logprobs?
        BeamSearch(prompt_ids, params, eos, vocab_size).check_logprob_limit(state.max_logprobs)
    except ValueError as e:
        raise APIError(str(e), param=width_param) from None
    try:
        check_logprobs_mode(getattr(engine.engine_args, "logprobs_mode", "raw_logprobs"))
    except ValueError as e:
        raise APIError(str(e), param="use_beam_search") from None
    return await run_async(one, prompt_ids, params, eos, decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                           disconnected=disconnected, vocab_size=vocab_size)


async def completion_response(req: Any, state: ServerState, model: str, request_id: str, created: int,
                              prompts: list, max_tokens: int, disconnected=None, cache_salt: Optional[str] = None,
                              priority: int = 0, data_parallel_rank: Optional[int] = None) -> dict:
    """cache_salt, priority, data_parallel_rank: the request's, as the handler checked them."""
    params, n = beam_search_params(req, max_tokens)
    lora = state.lora_request(model)
    results = await asyncio.gather(*(search(state, ids, params, disconnected, lora, cache_salt, priority,
                                            data_parallel_rank, _width_param(req)) for _, ids in prompts))
    choices, num_prompt, num_gen = [], 0, 0
    for i, ((_, ids), result) in enumerate(zip(prompts, results)):
        num_prompt += len(ids)
        for j, seq in enumerate(result.sequences[:n]):
            num_gen += len(seq.tokens) - len(ids)
            choice = {"index": i * n + j, "text": seq.text, "logprobs": None,
                      "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
            if req.return_token_ids:  # as the sampling path's choices
                choice.update(prompt_token_ids=list(ids), token_ids=list(seq.tokens[len(ids):]))
            choices.append(choice)
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(num_prompt, num_gen)}


async def chat_response(req: Any, state: ServerState, model: str, request_id: str, created: int,
                        prompt_ids: list[int], max_tokens: Optional[int], disconnected=None,
                        cache_salt: Optional[str] = None, priority: int = 0, role: str = "assistant",
                        data_parallel_rank: Optional[int] = None, reasoning: Any = None) -> dict:
    """cache_salt, priority, data_parallel_rank: the request's, as the handler checked them; role: the answer's;
    reasoning: the request's ChoiceReasoning (--reasoning-parser), which splits each beam's text."""
    params, n = beam_search_params(req, max_tokens)
    result = await search(state, prompt_ids, params, disconnected, state.lora_request(model), cache_salt, priority,
                          data_parallel_rank, _width_param(req))
    choices, num_gen = [], 0
    for j, seq in enumerate(result.sequences[:n]):
        num_gen += len(seq.tokens) - len(prompt_ids)
        message: dict = {"role": role, "content": seq.text}
        if reasoning is not None:  # as the sampling path's message: the think block as reasoning, the rest content
            thought, message["content"] = reasoning.split(seq.text or "")
            message.update(reasoning.fields(thought if reasoning.include else None))
        choice = {"index": j, "message": message, "logprobs": None,
                  "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = list(seq.tokens[len(prompt_ids):])
        choices.append(choice)
    body = {"id": request_id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(len(prompt_ids), num_gen)}
    if req.return_token_ids:  # as the sampling path's response
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def _width_param(req: Any) -> str:
    return "best_of" if getattr(req, "best_of", None) is not None else "n"


def _usage(num_prompt: int, num_gen: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_gen, "total_tokens": num_prompt + num_gen}
