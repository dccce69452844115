"""The FastAPI application: routes, OpenAI-style error mapping, API-key check.

Client mistakes are always 4xx with {"error": {"message", "type", "param", "code"}}: FastAPI's own 422
for validation errors is replaced by 400, unknown routes give 404 in the same shape, and a dead engine
gives 503 (never a hang).
"""
from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.entrypoints.async_engine import ClientDisconnected, EngineDeadError, RequestRejected
from pagedllm.entrypoints.openai.errors import APIError, dumps, error_body, error_response, format_validation_error
from pagedllm.entrypoints.openai.server_state import ServerState

logger = logging.getLogger("pagedllm.api_server")


class APIKeyMiddleware:
    """Pure ASGI (no per-request task, unlike BaseHTTPMiddleware): /v1/* needs `Authorization: Bearer KEY`."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS":
            auth = dict(scope["headers"]).get(b"authorization") or b""
            # constant time: how long the check takes says nothing about how much of the key matched
            if not hmac.compare_digest(auth, self.expected):
                body = dumps(error_body(
                    "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'.", 401,
                    "authentication_error", code="invalid_api_key"))
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    from pagedllm.entrypoints.openai.chat_completions import create_chat_completion
    from pagedllm.entrypoints.openai.completions import create_completion
    from pagedllm.entrypoints.openai.models import list_models
    from pagedllm.entrypoints.openai.openapi_bodies import body, install
    from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                      TokenizeRequest)
    from pagedllm.entrypoints.openai.tokenize import detokenize, tokenize

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=pagedllm.__version__)
    app.state.server = state
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.is_healthy():
            return Response(status_code=200)
        return Response(dumps(error_body(f"The engine is not running: {state.engine.dead_reason}", 503)),
                        status_code=503, media_type="application/json")

    @app.get("/version")
    async def version() -> Response:
        return Response(dumps({"version": pagedllm.__version__}), media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        from pagedllm.metrics import CONTENT_TYPE_LATEST

        await state.engine.get_stats()  # refresh the gauges from the engine
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        return await list_models(state)

    @app.post("/v1/completions", openapi_extra=body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await create_completion(request, state)

    @app.post("/v1/chat/completions", openapi_extra=body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, state)

    from pagedllm.entrypoints.openai.lora_models import (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest,
                                                         load_lora_adapter, loras_of, unload_lora_adapter)

    @app.post("/v1/load_lora_adapter", openapi_extra=body(LoadLoRAAdapterRequest))
    async def load_lora_route(request: Request) -> Response:
        return await load_lora_adapter(request, loras_of(state))

    @app.post("/v1/unload_lora_adapter", openapi_extra=body(UnloadLoRAAdapterRequest))
    async def unload_lora_route(request: Request) -> Response:
        return await unload_lora_adapter(request, loras_of(state))

    @app.post("/tokenize", openapi_extra=body(TokenizeRequest))
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(request, state)

    @app.post("/detokenize", openapi_extra=body(DetokenizeRequest))
    async def detokenize_route(request: Request) -> Response:
        return await detokenize(request, state)

    install(app)
    if getattr(state, "dashboard", True):  # --no-dashboard turns it off
        from pagedllm.entrypoints.dashboard.routes import install as install_dashboard

        install_dashboard(app, state)
    from fastapi.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> Response:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> Response:
        return error_response(format_validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:
        message = str(e.detail) if e.detail else "Error"
        if e.status_code == 404:
            message = "Not found: no such route."
        return error_response(APIError(message, e.status_code))

    @app.exception_handler(RequestRejected)
    async def rejected(_: Request, e: RequestRejected) -> Response:
        return error_response(APIError(str(e), e.status))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> Response:
        return error_response(APIError(f"The engine is not running: {e}", 503))

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> Response:
        from pagedllm.entrypoints.openai.guards import ClientTooSlow

        if isinstance(e, ClientTooSlow):  # already logged; the guard closes the connection
            return Response(status_code=499)
        logger.exception("unhandled error")
        return error_response(APIError(f"Internal server error: {type(e).__name__}: {e}", 500))
