"""--middleware IMPORT.PATH (vLLM's, repeatable): user ASGI middleware around the whole app.

A class is called as starlette's add_middleware calls it (`cls(app)`); an async function is an HTTP middleware
`async def f(request, call_next)` (FastAPI's `@app.middleware("http")`). As in vLLM, the last one given is the
outermost. They wrap the hot routes too, so every request passes them."""
from __future__ import annotations

import importlib
import inspect
from typing import Any


def load_middlewares(paths: list[str] | None) -> list[Any]:
    """The objects the import paths name; ValueError (said at start, before the model loads) for a bad one."""
    out = []
    for path in paths or []:
        module_path, _, name = path.rpartition(".")
        if not module_path:
            raise ValueError(f"--middleware {path}: expected an import path such as package.module.Name.")
        try:
            obj = getattr(importlib.import_module(module_path), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--middleware {path}: cannot import it: {e}") from e
        if not (inspect.isclass(obj) or inspect.iscoroutinefunction(obj)):
            raise ValueError(f"Invalid middleware {path}. Must be a function or a class.")
        out.append(obj)
    return out


def wrap_middlewares(app: Any, middlewares: list[Any]) -> Any:
    if not middlewares:
        return app
    app = _ThroughMiddlewares(app)
    for obj in middlewares:
        if inspect.isclass(obj):
            app = obj(app)
        else:
            from starlette.middleware.base import BaseHTTPMiddleware

            app = BaseHTTPMiddleware(app, dispatch=obj)
    return app


class _ThroughMiddlewares:
    """Streams write through the send they are given, not the guard's direct ones (guards.RAW_SEND_KEY /
    SERVER_SEND_KEY) that would bypass the user's middleware (which then sees no body, and its own end of the
    response comes after the stream's)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        from pagedllm.entrypoints.openai.guards import RAW_SEND_KEY, SERVER_SEND_KEY

        if RAW_SEND_KEY in scope or SERVER_SEND_KEY in scope:
            scope = {k: v for k, v in scope.items() if k not in (RAW_SEND_KEY, SERVER_SEND_KEY)}
        await self.app(scope, receive, send)
