"""StructuredOutputsParams: what one request's output must match (vLLM's names).

Exactly one of json / regex / choice / grammar / json_object / structural_tag is set. The object is plain data
(it travels inside SamplingParams to the engine process); the grammar engine compiles it there, keyed by
`key()`, so equal specs share one compiled grammar.
"""
from __future__ import annotations

import json as _json
import re
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_INTERNAL = ("origin", "reasoning_end", "reasoning_ended")  # set by the server, not a request's fields


def _check_integers(schema: dict, where: str) -> None:
    """The spec travels to the engine process as msgpack, whose integers are 64-bit: a wider one (a schema's
    "maximum": 10**30) could not be sent, a 500 rather than the client's 400."""
    stack: list = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, int) and not -(2 ** 63) <= node < 2 ** 64:
            raise ValueError(f"{where} holds the integer {node}, beyond 64 bits: write it as a "
                             "number with a fraction or exponent (e.g. 1e30).")


@dataclass
class StructuredOutputsParams:
    json: Optional[Union[str, dict]] = None  # a JSON schema (object or its JSON text)
    regex: Optional[str] = None
    choice: Optional[list[str]] = None  # the output is exactly one of these strings
    grammar: Optional[str] = None  # EBNF (GBNF) or Lark
    json_object: Optional[bool] = None  # any JSON object
    structural_tag: Optional[str] = None  # accepted by name only: refused with a message below
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens
    disable_additional_properties: bool = False  # objects without "additionalProperties" get false
    whitespace_pattern: Optional[str] = None  # accepted for vLLM compatibility (outlines only); refused if set
    disable_fallback: bool = False  # "auto" keeps xgrammar: a spec it refuses is a 400, not taken by llguidance
    # The request field the spec came from ("response_format.json_schema.schema", "guided_regex", "tools[0]...");
    # None: structured_outputs. Errors name it, so a client reads the field it sent. Not part of key().
    origin: Optional[str] = None
    # --reasoning-parser: the grammar starts after the reasoning (vLLM's). reasoning_end: the token ids of the parser's
    # end marker (`</think>`); until the output emits them the request samples freely and its matcher stays at the
    # start. reasoning_ended: the prompt already closed the reasoning (thinking off): the grammar applies at once.
    # Neither is part of key(): one compiled grammar serves requests with and without reasoning.
    reasoning_end: Optional[list[int]] = None
    reasoning_ended: bool = False

    def __post_init__(self) -> None:
        # The switches must be real booleans: the spec travels to the engine process typed, where a string (from a
        # request's free-form structured_outputs object) would fail to decode and stop the engine, not the request.
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            value = getattr(self, name)
            if value is None and name != "json_object":
                setattr(self, name, False)  # null: the default
            elif value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name} must be true or false, got {value!r}.")
        if self.json_object is False:
            self.json_object = None
        set_kinds = [k for k in _KINDS if getattr(self, k) is not None]
        if len(set_kinds) != 1:
            got = ", ".join(set_kinds) if set_kinds else "none"
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object "
                             f"(got {got}).")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported yet by pagedllm; use json, regex, "
                             "choice or grammar.")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is only supported by vLLM's outlines backend; "
                             "use disable_any_whitespace instead.")
        if self.reasoning_end is not None:
            if not isinstance(self.reasoning_end, (list, tuple)) or not self.reasoning_end \
                    or not all(isinstance(t, int) and not isinstance(t, bool) for t in self.reasoning_end):
                raise ValueError("StructuredOutputsParams.reasoning_end must be a non-empty list of token ids.")
            self.reasoning_end = [int(t) for t in self.reasoning_end]
        self.reasoning_ended = bool(self.reasoning_ended)
        if self.origin is not None and not isinstance(self.origin, str):
            raise ValueError("StructuredOutputsParams.origin must be the name of a request field.")
        where = self.where
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"{where} is not valid JSON: {e}.") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"{where} must be a JSON schema object, got {type(self.json).__name__}.")
        if self.json is not None:
            _check_integers(self.json, where)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"{where} must be a non-empty string.")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"{where} must be a non-empty EBNF or Lark grammar.")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError(f"{where} must be a non-empty list of strings.")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) is not None)

    @property
    def where(self) -> str:
        """The spec's name in messages: the request field it came from."""
        return self.origin or f"structured_outputs.{self.kind}"

    @property
    def param(self) -> str:
        """The top-level request field of the spec (an error's `param`)."""
        return re.match(r"[A-Za-z_]*", self.origin or "structured_outputs").group(0) or "structured_outputs"

    def key(self) -> tuple[str, str]:
        """(kind, canonical spec text): the compile cache's key."""
        kind = self.kind
        if kind == "json":
            spec: Any = _json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            spec = _json.dumps(self.choice)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        flags = f"{int(self.disable_any_whitespace)}{int(self.disable_additional_properties)}"
        if self.disable_fallback:  # (another backend choice under "auto")
            flags += "f"
        return kind, f"{flags}|{spec}"

    @classmethod
    def from_dict(cls, data: Any, origin: Optional[str] = None) -> "StructuredOutputsParams":
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(data).__name__}.")
        known = {f.name for f in fields(cls)} - set(_INTERNAL)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown structured_outputs field(s): {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}.")
        return cls(**data, origin=origin)


class SpecError(ValueError):
    """A spec the grammar library refuses (or that admits no output): "Invalid <field>: <reason>", the field named
    as the client sent it. One compile serves every request with an equal spec (whatever field each used), so the
    reason is kept apart and for_params() words it for another request."""

    def __init__(self, params: StructuredOutputsParams, reason: str) -> None:
        super().__init__(f"Invalid {params.where}: {reason}")
        self.reason = reason
        self.param = params.param

    def for_params(self, params: StructuredOutputsParams) -> "SpecError":
        return SpecError(params, self.reason)
