"""Declare the real request bodies in the OpenAPI schema (/openapi.json, /docs) without changing how routes
parse them.

The endpoints read the raw body themselves (body.parse_body: OpenAI-shaped 400s, limits), so FastAPI sees
no body parameter and would publish none. `body(Model)` goes into a route's `openapi_extra`; `install(app)`
adds every model so referenced (and the models they use) to the schema's components. The schema is
generated from the pydantic models, so a field added to a model appears in /docs and in the fuzzing tests
with no further change.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_MODELS: dict[str, type[BaseModel]] = {}


def body(model: type[BaseModel], description: str = "") -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    _MODELS[model.__name__] = model
    extra: dict[str, Any] = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}}
    if description:
        extra["requestBody"]["description"] = description
    return extra


def install(app: Any) -> None:
    """Make app.openapi() carry the schemas of every model passed to body()."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, model in _MODELS.items():
            model_schema = model.model_json_schema(ref_template=_REF, mode="validation")
            for def_name, definition in model_schema.pop("$defs", {}).items():
                components.setdefault(def_name, definition)
            components[name] = model_schema
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
