"""The FastAPI application: routes, OpenAI-style error mapping, API-key check.

Client mistakes are always 4xx with {"error": {"message", "type", "param", "code"}}: FastAPI's own 422
for validation errors is replaced by 400, unknown routes give 404 in the same shape, and a dead engine
gives 503 (never a hang).
"""
from __future__ import annotations

import hmac
import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.entrypoints.async_engine import ClientDisconnected, EngineDeadError, RequestRejected
from pagedllm.entrypoints.openai.errors import (APIError, dumps, error_body, error_response, format_validation_error,
                                               log_error_stack)
from pagedllm.entrypoints.openai.guards import route_path
from pagedllm.entrypoints.openai.server_state import ServerState

logger = logging.getLogger("pagedllm.api_server")


# Routes behind --api-key: the OpenAI API, vLLM's scoring, classify and pooling routes outside /v1 (they run the
# model), and the dev-mode routes that change the engine's state (openai/admin.py; vLLM leaves them open, its
# security guide says).
KEYED_PREFIXES = ("/v1", "/v2/", "/score", "/rerank", "/classify", "/pooling", "/invocations", "/sleep", "/wake_up",
                  "/is_sleeping", "/reset_prefix_cache")


def api_key_refused(scope: dict, expected: bytes) -> bool:
    """Whether a request lacks the key: /v1/* and the scoring routes (but CORS preflights) need
    `Authorization: Bearer KEY`."""
    if not route_path(scope).startswith(KEYED_PREFIXES) or scope.get("method") == "OPTIONS":
        return False
    auth = b""
    for name, value in scope["headers"]:
        if name == b"authorization":
            auth = value  # the last one, as a dict of the headers would keep
    # constant time: how long the check takes says nothing about how much of the key matched
    return not hmac.compare_digest(auth, expected)


async def send_api_key_refusal(send: Any) -> None:
    body = dumps(error_body("Incorrect API key provided: pass it as 'Authorization: Bearer <key>'.", 401,
                            "authentication_error", code="invalid_api_key"))
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Pure ASGI (no per-request task, unlike BaseHTTPMiddleware): /v1/* needs `Authorization: Bearer KEY`."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and api_key_refused(scope, self.expected):
            await send_api_key_refusal(send)
            return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    from pagedllm.entrypoints.openai.chat_completions import create_chat_completion
    from pagedllm.entrypoints.openai.completions import create_completion
    from pagedllm.entrypoints.openai.embeddings import EmbeddingRequest, create_embedding
    from pagedllm.entrypoints.openai.models import list_models, retrieve_model
    from pagedllm.entrypoints.openai.openapi_bodies import body, install
    from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                      TokenizeRequest)
    from pagedllm.entrypoints.openai.responses import create_response
    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
    from pagedllm.entrypoints.openai.tokenize import detokenize, tokenize

    docs = {} if getattr(state, "fastapi_docs", True) else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pagedllm OpenAI-compatible server", version=pagedllm.__version__, **docs)
    app.state.server = state
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.is_healthy():
            return Response(status_code=200)
        return Response(dumps(error_body(f"The engine is not running: {state.engine.dead_reason}", 503)),
                        status_code=503, media_type="application/json")

    app.add_api_route("/ping", health, methods=["GET", "POST"])  # SageMaker's health check: the same answer

    @app.get("/load")
    async def load() -> Response:
        # vLLM's: this API process's requests in flight on the generation / pooling routes; 0 unless the server
        # runs with --enable-server-load-tracking
        lifecycle = getattr(state, "lifecycle", None)
        return Response(dumps({"server_load": lifecycle.server_load if lifecycle is not None else 0}),
                        media_type="application/json")

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

    @app.get("/v1/models/{model:path}")  # (a path: LoRA and hub names hold slashes)
    async def model_card(model: str) -> Response:
        return await retrieve_model(state, model)

    @app.post("/v1/completions", openapi_extra=body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await create_completion(request, state)

    @app.post("/v1/chat/completions", openapi_extra=body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, state)

    @app.post("/v1/responses", openapi_extra=body(ResponsesRequest))
    async def responses(request: Request) -> Response:
        return await create_response(request, state)

    @app.post("/v1/embeddings", openapi_extra=body(EmbeddingRequest))
    async def embeddings(request: Request) -> Response:
        return await create_embedding(request, state)

    from pagedllm.entrypoints.openai.scoring import RerankRequest, ScoreRequest, create_rerank, create_score

    async def score(request: Request) -> Response:
        return await create_score(request, state)

    async def rerank(request: Request) -> Response:
        return await create_rerank(request, state)

    from pagedllm.entrypoints.openai.classify import ClassificationRequest, create_classification

    async def classify(request: Request) -> Response:
        return await create_classification(request, state)

    from pagedllm.entrypoints.openai.pooling_api import PoolingAPIRequest, create_pooling

    @app.post("/pooling", openapi_extra=body(PoolingAPIRequest))
    async def pooling(request: Request) -> Response:
        return await create_pooling(request, state)

    # vLLM's other paths of the same routes (the schema lists each route once)
    for path in ("/classify", "/v1/classify"):
        app.add_api_route(path, classify, methods=["POST"], openapi_extra=body(ClassificationRequest),
                          include_in_schema=path == "/classify")
    for path in ("/v1/score", "/score"):
        app.add_api_route(path, score, methods=["POST"], openapi_extra=body(ScoreRequest),
                          include_in_schema=path == "/v1/score")
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"], openapi_extra=body(RerankRequest),
                          include_in_schema=path == "/v1/rerank")

    from pagedllm.entrypoints.openai.invocations import invocations

    @app.post("/invocations")
    async def invocations_route(request: Request) -> Response:
        return await invocations(request, state)

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

    if getattr(state, "tokenizer_info_endpoint", False):  # --enable-tokenizer-info-endpoint (else 404, as vLLM)
        from pagedllm.entrypoints.openai.tokenize import tokenizer_info

        @app.get("/tokenizer_info")
        async def tokenizer_info_route() -> Response:
            return tokenizer_info(state)

    from pagedllm.entrypoints.openai.admin import install as install_admin

    install_admin(app, state)  # sleep mode, reset_prefix_cache: only with PAGEDLLM_SERVER_DEV_MODE=1
    install(app)
    if getattr(state, "dashboard", True):  # --no-dashboard turns it off
        from pagedllm.entrypoints.dashboard.routes import install as install_dashboard

        install_dashboard(app, state)
    from fastapi.middleware.cors import CORSMiddleware

    cors = getattr(state, "cors", None) or {}  # --allowed-origins / --allowed-methods / --allowed-headers / ...
    app.add_middleware(CORSMiddleware, allow_origins=cors.get("origins", ["*"]),
                       allow_methods=cors.get("methods", ["*"]), allow_headers=cors.get("headers", ["*"]),
                       allow_credentials=cors.get("credentials", False))
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)
    return app


def handled_error_response(e: BaseException) -> Optional[Response]:
    """The answer to an exception a route raised before its response started (the app's exception handlers and
    the hot routes share it); None for an unexpected one (internal_error_response)."""
    response = _handled_error_response(e)
    if response is not None and response.status_code != 499:
        log_error_stack(e, response.status_code)
    return response


def _handled_error_response(e: BaseException) -> Optional[Response]:
    if isinstance(e, APIError):
        return error_response(e)
    if isinstance(e, RequestValidationError):
        return error_response(format_validation_error(e))
    if isinstance(e, StarletteHTTPException):
        message = str(e.detail) if e.detail else "Error"
        if e.status_code == 404:
            message = "Not found: no such route."
        response = error_response(APIError(message, e.status_code))
        # the exception's headers: a 405's Allow (which HTTP requires of it) names the methods the route takes
        response.headers.update(e.headers or {})
        return response
    if isinstance(e, RequestRejected):
        return error_response(APIError(str(e), e.status, param=getattr(e, "param", None)))
    if isinstance(e, EngineDeadError):
        return error_response(APIError(f"The engine is not running: {e}", 503))
    if isinstance(e, ClientDisconnected):
        return Response(status_code=499)
    return None


def internal_error_response(e: BaseException) -> Response:
    from pagedllm.entrypoints.openai.guards import ClientTooSlow

    if isinstance(e, ClientTooSlow):  # already logged; the guard closes the connection
        return Response(status_code=499)
    logger.exception("unhandled error", exc_info=e)
    return error_response(APIError(f"Internal server error: {type(e).__name__}: {e}", 500))


def _install_error_handlers(app: FastAPI) -> None:
    async def handled(_: Request, e: Exception) -> Response:
        response = handled_error_response(e)
        assert response is not None
        return response

    for exc in (APIError, RequestValidationError, StarletteHTTPException, RequestRejected, EngineDeadError,
                ClientDisconnected):
        app.add_exception_handler(exc, handled)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> Response:
        return internal_error_response(e)
