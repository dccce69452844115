"""POST /tokenize and POST /detokenize (vLLM's extras; used by `bench serve` and clients), GET /tokenizer_info
(with --enable-tokenizer-info-endpoint)."""
from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.body import parse_body, render_work, tokenize_work
from pagedllm.entrypoints.openai.chat_template import check_request_template, render_chat
from pagedllm.entrypoints.openai.chat_tools import plan_request_tools
from pagedllm.entrypoints.openai.errors import APIError, dumps
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest


async def tokenize(request: Request, state: ServerState) -> Response:
    req = await parse_body(request, TokenizeRequest)
    state.check_model(req.model)
    tok = state.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError("Give exactly one of 'prompt' or 'messages'.", param="prompt")
    if req.messages is not None:
        check_request_template(req.chat_template, state)
        add_special = bool(req.add_special_tokens) if req.add_special_tokens is not None else False
        _, prepare_tools = plan_request_tools(req, state)  # (tools and tool history rendered as the chat route does)
        _, ids = await render_work(request, req, render_chat, tok, req.messages, req.add_generation_prompt,
                                   req.continue_final_message, req.chat_template, req.chat_template_kwargs,
                                   add_special, prepare_tools=prepare_tools,
                                   content_format=state.chat_template_content_format)
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = list(await tokenize_work(request, tok.encode, req.prompt, add_special_tokens=add_special))
    # token_strs: null unless asked for, as vLLM's answer has it (a client may read the key)
    body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}
    return Response(dumps(body), media_type="application/json")


async def detokenize(request: Request, state: ServerState) -> Response:
    req = await parse_body(request, DetokenizeRequest)
    state.check_model(req.model)
    text = await tokenize_work(request, _detokenize, state.tokenizer, req.tokens, state.engine.ready.vocab_size)
    return Response(dumps({"prompt": text}), media_type="application/json")


def _detokenize(tokenizer: Any, ids: list[int], vocab: int) -> str:
    """(In a worker thread for a large body: a million ids take seconds to check and decode.)"""
    for t in ids:
        if not 0 <= t < vocab:
            raise APIError(f"Token id {t} is out of vocabulary (0..{vocab - 1}).", param="tokens")
    return tokenizer.decode(ids)


def tokenizer_info(state: ServerState) -> Response:
    """vLLM's GET /tokenizer_info: the tokenizer's init_kwargs less its file paths, AddedToken values as their text,
    plus `tokenizer_class` (the class's name) and the server's --chat-template when one was given."""
    tok = state.tokenizer
    config = dict(getattr(tok, "init_kwargs", None) or {})
    config.pop("vocab_file", None)
    config.pop("merges_file", None)
    config = _jsonable(config)
    config["tokenizer_class"] = type(tok).__name__
    if state.chat_template:
        config["chat_template"] = state.chat_template
    # default=str: a value of a type JSON has no name for (a custom tokenizer's option) is shown, not a 500
    return Response(json.dumps(config, default=str), media_type="application/json")


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "content"):  # AddedToken -> its text
        return obj.content
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    return obj
