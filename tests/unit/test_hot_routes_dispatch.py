"""HotRoutes' dispatch (entrypoints/openai/hot_routes.py): which requests it serves and which it hands to the
app, its key check, and its error answers. The endpoints here are stand-ins that raise or answer; the real
endpoints on a real server are compared with the app's path in tests/e2e/test_hot_routes.py."""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.responses import Response

from pagedllm.entrypoints.async_engine import EngineDeadError
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.hot_routes import HotRoutes
from pagedllm.entrypoints.openai.server_state import ServerState


def _run(routes: HotRoutes, method: str, path: str, headers: list) -> tuple[list, list]:
    sent, app_calls = [], []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(routes(scope, receive, send))
    return sent, app_calls


def _routes(endpoint, api_key=None) -> tuple[HotRoutes, list]:
    app_calls = []

    async def app(scope, receive, send) -> None:
        app_calls.append(scope["path"])
        await Response(b"app", status_code=200)(scope, receive, send)

    routes = HotRoutes(app, ServerState(None, ["m"], api_key=api_key))
    routes.routes = {"/v1/completions": endpoint, "/v1/chat/completions": endpoint}
    return routes, app_calls


async def _ok(request, state) -> Response:
    return Response(b"hot", status_code=200)


@pytest.mark.parametrize("method,path,headers,hot", [
    ("POST", "/v1/completions", [], True),
    ("POST", "/v1/chat/completions", [(b"content-type", b"application/json")], True),
    ("POST", "/v1/completions", [(b"origin", b"http://x")], False),  # CORS: the app's middleware answers
    ("GET", "/v1/completions", [], False),
    ("POST", "/v1/completions/", [], False),
    ("POST", "/tokenize", [], False),
])
def test_dispatch(method: str, path: str, headers: list, hot: bool) -> None:
    routes, app_calls = _routes(_ok)
    sent, _ = _run(routes, method, path, headers)
    assert sent[-1]["body"] == (b"hot" if hot else b"app")
    assert app_calls == ([] if hot else [path])


def test_key_checked_on_the_hot_route() -> None:
    routes, app_calls = _routes(_ok, api_key="k")
    sent, _ = _run(routes, "POST", "/v1/completions", [])
    assert sent[0]["status"] == 401 and json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"
    sent, _ = _run(routes, "POST", "/v1/completions", [(b"authorization", b"Bearer k")])
    assert sent[0]["status"] == 200 and sent[-1]["body"] == b"hot"
    assert app_calls == []


@pytest.mark.parametrize("error,status", [(APIError("bad", param="x"), 400), (EngineDeadError("gone"), 503),
                                          (APIError("nope", 404), 404)])
def test_handled_errors(error: Exception, status: int) -> None:
    async def failing(request, state):
        raise error

    routes, _ = _routes(failing)
    sent, _ = _run(routes, "POST", "/v1/completions", [])
    assert sent[0]["status"] == status
    assert set(json.loads(sent[1]["body"])["error"]) == {"message", "type", "param", "code"}


def test_unexpected_error_answered_then_raised() -> None:
    async def broken(request, state):
        raise ZeroDivisionError("boom")

    routes, _ = _routes(broken)
    sent = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    with pytest.raises(ZeroDivisionError):
        asyncio.run(routes({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive, send))
    assert sent[0]["status"] == 500
    assert "ZeroDivisionError: boom" in json.loads(sent[1]["body"])["error"]["message"]
