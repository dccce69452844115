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
    for obj in middlewares:
        if inspect.isclass(obj):
            app = obj(app)
        else:
            from starlette.middleware.base import BaseHTTPMiddleware

            app = BaseHTTPMiddleware(app, dispatch=obj)
    return app
