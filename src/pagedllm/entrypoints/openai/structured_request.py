"""Request fields -> StructuredOutputsParams: OpenAI's response_format, vLLM's structured_outputs and its older
guided_json / guided_regex / guided_choice / guided_grammar / guided_decoding_backend extras.

Shape errors are refused here with the field's name; the spec itself (is the schema valid?) is checked by the
grammar library in the engine, whose message comes back as a 400 too, naming the field the client sent: the spec
carries it (StructuredOutputsParams.origin).
"""
from __future__ import annotations

import json
from typing import Any, Optional

from pagedllm.entrypoints.openai.protocol import field_or_none
from pagedllm.structured_output.params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredRequestError(ValueError):
    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


def _response_format(rf: Any) -> Optional[tuple[str, dict]]:
    """(the spec's origin, the spec) or None."""
    if rf is None:
        return None
    rf = rf if isinstance(rf, dict) else rf.model_dump(exclude_none=True)
    kind = rf.get("type")
    if kind is None:
        raise StructuredRequestError("response_format needs a 'type': 'text', 'json_object' or 'json_schema'.",
                                     "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise StructuredRequestError("response_format of type 'json_schema' needs a 'json_schema' object with "
                                         "'name' and 'schema'.", "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            schema = {"type": "object"}  # OpenAI allows a name-only json_schema: any object
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise StructuredRequestError(f"response_format.json_schema.schema is not valid JSON: {e}.",
                                             "response_format") from None
        if not isinstance(schema, dict):
            raise StructuredRequestError("response_format.json_schema.schema must be a JSON schema object.",
                                         "response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise StructuredRequestError(f"response_format.json_schema.strict must be true or false, got {strict!r}.",
                                         "response_format")
        # strict or not, the output follows the schema exactly: the grammar allows nothing else (docs/
        # architecture.md, "Structured outputs": objects that list properties are closed unless they say otherwise).
        return "response_format.json_schema.schema", {"json": schema}
    if kind == "structural_tag":
        raise StructuredRequestError("response_format of type 'structural_tag' is not supported yet by pagedllm.",
                                     "response_format")
    raise StructuredRequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                                 f"{kind!r}.", "response_format")


def structured_outputs_from_request(req: Any) -> Optional[StructuredOutputsParams]:
    """The request's one output constraint, or None. More than one source at once is a 400."""
    found: list[tuple[str, dict]] = []
    origins = {"structured_outputs": None}  # None: the spec's own structured_outputs.<kind> names
    rf = _response_format(field_or_none(req, "response_format"))
    if rf is not None:
        origins["response_format"] = rf[0]
        found.append(("response_format", rf[1]))
    so = field_or_none(req, "structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise StructuredRequestError("structured_outputs must be an object.", "structured_outputs")
        found.append(("structured_outputs", dict(so)))
    for field, kind in _GUIDED.items():
        value = field_or_none(req, field)
        if value is not None:
            found.append((field, {kind: value}))
    if field_or_none(req, "guided_json_object"):
        found.append(("guided_json_object", {"json_object": True}))
    if not found:
        if field_or_none(req, "guided_whitespace_pattern") is not None:
            raise StructuredRequestError("guided_whitespace_pattern shapes the whitespace of a JSON constraint: give it "
                                         "with guided_json or a JSON response_format.", "guided_whitespace_pattern")
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise StructuredRequestError(f"Give one output constraint, not several ({names}).", found[1][0])
    param, spec = found[0]
    if field_or_none(req, "guided_whitespace_pattern") is not None:  # named as sent (the spec would say its own)
        raise StructuredRequestError("guided_whitespace_pattern is only supported by vLLM's outlines backend; use "
                                     "--structured-outputs-config '{\"disable_any_whitespace\": true}' or "
                                     "structured_outputs.disable_any_whitespace instead.", "guided_whitespace_pattern")
    try:
        return StructuredOutputsParams.from_dict(spec, origin=origins.get(param, param))
    except (ValueError, TypeError) as e:
        raise StructuredRequestError(str(e), param) from None
