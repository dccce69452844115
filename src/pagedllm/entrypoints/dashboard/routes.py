"""The dashboard's HTTP routes (`install` is called by openai/app.py's build_app unless --no-dashboard):

  GET  /dashboard                the page (behind --api-key: 401 and a small key form without it)
  GET  /dashboard/events         the server-sent events the page draws (~4 a second; behind --api-key)
  POST /dashboard/login          {"api_key": KEY} -> an HttpOnly cookie for the two routes above
  GET  /dashboard/assets/NAME    the page's own JS / CSS (package data, no CDN; they hold no data: open)

A browser cannot put `Authorization: Bearer KEY` on a page load or an EventSource, so with --api-key the page
accepts either that header (curl, scripts) or the cookie the key form sets: an HMAC of the key (the key itself is
never stored in the browser), `SameSite=Strict` (other sites' pages cannot use it), scoped to /dashboard. The key never
goes into a URL, where access logs and browser history would keep it. The page's URLs are relative, so it also
works under a path prefix.
"""
from __future__ import annotations

import hashlib
import hmac
from functools import lru_cache
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.entrypoints.dashboard.feed import DashboardFeed
from pagedllm.entrypoints.openai.body import loads_body
from pagedllm.entrypoints.openai.errors import APIError, dumps, error_body

COOKIE = "pagedllm_dashboard"
ASSET_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
               ".html": "text/html; charset=utf-8"}
# Everything the page loads comes from this server; nothing inline, no frames.
_PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; "
                               "form-action 'self'",
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def install(app: FastAPI, state: Any) -> DashboardFeed:
    feed = DashboardFeed(state)
    app.state.dashboard = feed

    @app.get("/dashboard", include_in_schema=False)
    async def page(request: Request) -> Response:
        if not authorized(request, state.api_key):
            if "text/html" in request.headers.get("accept", ""):
                return Response(asset("login.html"), status_code=401, media_type=ASSET_TYPES[".html"],
                                headers={**_PAGE_HEADERS, "www-authenticate": "Bearer"})
            return unauthorized()
        return Response(asset("dashboard.html"), media_type=ASSET_TYPES[".html"], headers=_PAGE_HEADERS)

    @app.get("/dashboard/events", include_in_schema=False)
    async def events(request: Request) -> Response:
        if not authorized(request, state.api_key):
            return unauthorized()

        def draining() -> bool:  # the stream ends when the server starts to drain (openai/lifecycle.py)
            return bool(getattr(getattr(state, "lifecycle", None), "draining", False))

        return StreamingResponse(feed.stream(is_over=draining), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    @app.post("/dashboard/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        try:  # (the API's parser: JSON nested 100000 deep is a RecursionError to json.loads, a lone surrogate
            # escape valid JSON but no key)
            body = loads_body(await request.body())
        except APIError:
            body = None
        key = body.get("api_key") if isinstance(body, dict) else None
        if not isinstance(key, str):
            return Response(dumps(error_body("The body must be {\"api_key\": \"...\"}.", 400, param="api_key")),
                            status_code=400, media_type="application/json")
        if state.api_key and not hmac.compare_digest(key.encode(), state.api_key.encode()):
            return unauthorized()
        response = Response(status_code=204)
        if state.api_key:
            secure = request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"
            # no Path attribute: the browser's default, this URL's directory (/dashboard, or /PREFIX/dashboard
            # behind a proxy that mounts the server under a prefix)
            response.set_cookie(COOKIE, cookie_token(state.api_key), path=None, httponly=True,
                                samesite="strict", secure=secure)
        return response

    @app.get("/dashboard/assets/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        suffix = name[name.rfind("."):] if "." in name else ""
        if suffix not in ASSET_TYPES or name not in asset_names():
            return Response(dumps(error_body("Not found: no such dashboard asset.", 404)), status_code=404,
                            media_type="application/json")
        return Response(asset(name), media_type=ASSET_TYPES[suffix],
                        headers={"cache-control": "no-cache", "x-content-type-options": "nosniff"})

    return feed


def cookie_token(api_key: str) -> str:
    """What the cookie holds: derived from the key, so the browser never stores the key itself."""
    return hmac.new(api_key.encode(), b"pagedllm dashboard cookie v1", hashlib.sha256).hexdigest()


def authorized(request: Request, api_key: Any) -> bool:
    if not api_key:
        return True
    # constant time, like APIKeyMiddleware: the time taken says nothing about how much matched
    header = dict(request.scope["headers"]).get(b"authorization") or b""
    if hmac.compare_digest(header, f"Bearer {api_key}".encode()):
        return True
    cookie = request.cookies.get(COOKIE, "")
    return hmac.compare_digest(cookie.encode(errors="replace"), cookie_token(api_key).encode())


def unauthorized() -> Response:
    body = dumps(error_body("Incorrect API key provided: pass it as 'Authorization: Bearer <key>', or enter it on "
                            "the /dashboard page.", 401, "authentication_error", code="invalid_api_key"))
    return Response(body, status_code=401, media_type="application/json", headers={"www-authenticate": "Bearer"})


@lru_cache(maxsize=None)
def asset_names() -> frozenset:
    return frozenset(p.name for p in _assets().iterdir() if p.is_file())


@lru_cache(maxsize=None)
def asset(name: str) -> bytes:
    return (_assets() / name).read_bytes()


def _assets() -> Any:
    return resources.files("pagedllm.entrypoints.dashboard") / "assets"
