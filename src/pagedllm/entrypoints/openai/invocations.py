"""POST /invocations (vLLM's SageMaker route): the body goes to the first route whose request model it validates
as, in vLLM's order: chat, completions (a generating model), then the pooling routes of the model's tasks."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from pagedllm.entrypoints.openai.body import OFF_LOOP_BYTES, loads_body
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.server_state import ServerState

Handler = Callable[[Request, ServerState], Awaitable[Response]]


def _routes(state: ServerState) -> list[tuple[type, Handler]]:
    from pagedllm.entrypoints.openai.chat_completions import create_chat_completion
    from pagedllm.entrypoints.openai.classify import ClassificationRequest, create_classification
    from pagedllm.entrypoints.openai.completions import create_completion
    from pagedllm.entrypoints.openai.embeddings import EmbeddingRequest, create_embedding
    from pagedllm.entrypoints.openai.pooling_api import PoolingAPIRequest, create_pooling, served_tasks
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from pagedllm.entrypoints.openai.scoring import RerankRequest, ScoreRequest, create_rerank, create_score

    engine = state.engine
    routes: list[tuple[type, Handler]] = []
    if not getattr(engine.engine_args, "embeddings_only", False) and engine.ready.classifier_labels is None:
        routes += [(ChatCompletionRequest, create_chat_completion), (CompletionRequest, create_completion)]
    tasks = served_tasks(state)
    if "embed" in tasks:
        routes.append((EmbeddingRequest, create_embedding))
    if "classify" in tasks:
        routes.append((ClassificationRequest, create_classification))
    routes += [(ScoreRequest, create_score), (RerankRequest, create_rerank), (PoolingAPIRequest, create_pooling)]
    return routes


def _handler(raw: bytes, routes: list[tuple[type, Handler]]) -> Handler:
    data: Any = loads_body(raw)
    for model, handler in routes:
        try:
            req = model.model_validate(data)
        except ValidationError:
            continue
        # A pooling request is vLLM's union of an input request and a messages one: it needs one of the two (a
        # score body would pass as one with neither)
        if "messages" in model.model_fields and "input" in model.model_fields \
                and req.input is None and req.messages is None:
            continue
        # a completion needs a prompt or prompt embeddings (both optional fields): else an embedding body would pass
        if "prompt_embeds" in model.model_fields and req.prompt is None and req.prompt_embeds is None:
            continue
        return handler
    names = ", ".join(model.__name__ for model, _ in routes)
    raise APIError(f"Cannot find suitable handler for request. Expected one of: [{names}]")


async def invocations(request: Request, state: ServerState) -> Response:
    raw = await request.body()  # (starlette keeps it for the route, which reads it again)
    routes = _routes(state)
    if len(raw) < OFF_LOOP_BYTES:
        handler = _handler(raw, routes)
    else:  # (a body of megabytes: its JSON and validation off the event loop, as parse_body does)
        handler = await asyncio.to_thread(_handler, raw, routes)
    return await handler(request, state)
