"""The generating routes are served in front of the FastAPI app (entrypoints/openai/hot_routes.py); a request
with an `Origin` header (a browser) still takes the app's whole stack, CORS included. Both paths must answer
alike: same statuses, same error bodies, same generations, same stream framing; only CORS headers differ."""
from __future__ import annotations

import json

import httpx
import pytest

from e2e_helpers import API_KEY, SERVED_NAME, Server

CMPL, CHAT, RESP = "/v1/completions", "/v1/chat/completions", "/v1/responses"
ORIGIN = {"Origin": "http://example.test"}
MSG = [{"role": "user", "content": "Say hi."}]
KEY = {"Authorization": f"Bearer {API_KEY}"}

CASES = [
    (CMPL, {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}, 200),
    (CHAT, {"messages": MSG, "max_tokens": 6, "temperature": 0}, 200),
    (CMPL, {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}, 200),
    (CMPL, b"{not json", 400),
    (CMPL, {"prompt": "x", "model": "no-such-model"}, 404),
    (CMPL, {"prompt": [49152000]}, 400),
    (CHAT, {"messages": [{"content": "no role"}]}, 400),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "bogus"}, 400),
    (CMPL, {"prompt": "x", "max_tokens": 5000}, 400),
    (RESP, {"input": "x", "model": "no-such-model"}, 404),
    (RESP, {"input": "x", "background": True}, 400),
]


def _post(server: Server, path: str, body, headers: dict) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={**headers, "content-type": "application/json"},
                          timeout=120)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def _comparable(r: httpx.Response) -> object:
    if r.headers.get("content-type", "").startswith("application/json"):
        body = r.json()
        for key in ("id", "created"):
            body.pop(key, None)
        return body
    return r.content


@pytest.mark.parametrize("path,body,status", CASES, ids=[f"{i}-{c[0]}-{c[2]}" for i, c in enumerate(CASES)])
def test_hot_route_answers_as_the_app(server: Server, path: str, body, status: int) -> None:
    hot = _post(server, path, body, KEY)
    app = _post(server, path, body, {**KEY, **ORIGIN})
    assert hot.status_code == app.status_code == status, (hot.text, app.text)
    assert _comparable(hot) == _comparable(app)
    assert "access-control-allow-origin" not in hot.headers
    assert app.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}], ids=["none", "wrong"])
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_hot_route_key_check(server: Server, path: str, headers: dict) -> None:
    body = {"prompt": "x", "max_tokens": 1} if path == CMPL else {"messages": MSG, "max_tokens": 1}
    for extra in ({}, ORIGIN):
        r = _post(server, path, body, {**headers, **extra})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"


def _stream_lines(server: Server, path: str, body: dict, headers: dict) -> tuple[httpx.Headers, list[dict]]:
    with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
        head = r.headers
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    for c in chunks:
        c.pop("id"), c.pop("created")
    return head, chunks


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_hot_route_streams_as_the_app(server: Server, path: str) -> None:
    body = {"max_tokens": 8, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"prompt": "Once upon a time"} if path == CMPL else {"messages": MSG})
    hot_headers, hot = _stream_lines(server, path, body, KEY)
    app_headers, app = _stream_lines(server, path, body, {**KEY, **ORIGIN})
    assert hot == app
    assert hot[-1]["usage"]["completion_tokens"] == 8
    assert all(c["model"] == SERVED_NAME for c in hot)
    assert "access-control-allow-origin" not in hot_headers
    assert app_headers["access-control-allow-origin"] == "*"


def test_cors_preflight_and_other_methods(server: Server) -> None:
    r = httpx.options(server.url + CMPL, headers={**ORIGIN, "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200  # no key: a preflight carries none
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.get(server.url + CMPL, headers=KEY)  # not the hot route's method: the app says 405
    assert r.status_code == 405
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
