"""The model's routes (POST /v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings) served in front
of the FastAPI app, below none of its layers: a request there would otherwise pass a dozen of the framework's
middlewares and wrappers (error middleware, telemetry and body-limit layers, CORS, exception middleware, the
router's matching, the dependency solver) before the endpoint, each run once per request and again per message
sent.

Behaviour is the app's: the same endpoints, the API key checked as `APIKeyMiddleware` checks it, exceptions
answered by the app's own handlers (`app.handled_error_response` / `app.internal_error_response`, an unexpected
one re-raised after its 500 as starlette's error middleware does). A request that carries an `Origin` header (a
browser: CORS) and every other route go to the app. What runs outside the app (RequestGuard's body limits and
send timeout, DrainMiddleware's drain and request counts) is outside this layer too.
"""
from __future__ import annotations

from typing import Any, Optional

from starlette.requests import Request

from pagedllm.entrypoints.openai.app import (api_key_refused, handled_error_response, internal_error_response,
                                             send_api_key_refusal)
from pagedllm.entrypoints.openai.guards import route_path
from pagedllm.entrypoints.openai.server_state import ServerState


class HotRoutes:
    def __init__(self, app: Any, state: ServerState) -> None:
        from pagedllm.entrypoints.openai.chat_completions import create_chat_completion
        from pagedllm.entrypoints.openai.completions import create_completion
        from pagedllm.entrypoints.openai.embeddings import create_embedding
        from pagedllm.entrypoints.openai.responses import create_response

        self.app = app
        self.state = state
        self.routes = {"/v1/completions": create_completion, "/v1/chat/completions": create_chat_completion,
                       "/v1/responses": create_response, "/v1/embeddings": create_embedding}
        self.expected_key: Optional[bytes] = f"Bearer {state.api_key}".encode() if state.api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        endpoint = self.routes.get(route_path(scope)) if scope["type"] == "http" else None
        if endpoint is None or scope.get("method") != "POST" or _has_origin(scope["headers"]):
            await self.app(scope, receive, send)
            return
        if self.expected_key is not None and api_key_refused(scope, self.expected_key):
            await send_api_key_refusal(send)
            return
        try:
            response = await endpoint(Request(scope, receive), self.state)
        except Exception as e:  # noqa: BLE001 - answered as the app's exception handlers answer it
            response = handled_error_response(e)
            if response is None:
                await internal_error_response(e)(scope, receive, send)
                raise  # as starlette's ServerErrorMiddleware does: the server logs it
        await response(scope, receive, send)


def _has_origin(headers: list) -> bool:
    for name, _ in headers:
        if name == b"origin":
            return True
    return False
