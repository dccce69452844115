"""ToolParser: a model's raw completion text -> (content, tool calls). One subclass per output format.

Invariant: extract() never raises on model output. Text that does not parse as this format's calls (or names a
tool that was not offered) comes back whole as plain content, with no calls.
"""
from __future__ import annotations

import json
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional


def make_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_ALPHANUMERIC = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def make_mistral_call_id() -> str:
    """Mistral's chat templates refuse a tool call id that is not 9 alphanumeric characters when the call comes
    back in the history (as vLLM's mistral parser, its calls get such ids)."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=make_call_id)
    type: str = "function"

    def to_openai(self) -> dict:
        return {"id": self.id, "type": self.type, "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: Optional[str]
    tool_calls: list[ToolCall] = field(default_factory=list)
    complete: bool = True  # False: the calls leave finish_reason as it is (a named tool_choice: "stop")

    @property
    def called(self) -> bool:
        return bool(self.tool_calls)


def arguments_text(args: Any) -> Optional[str]:
    """A call's arguments as JSON object text; None if they are not an object (or its text)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def call_from_object(obj: Any) -> Optional[ToolCall]:
    """{"name": ..., "arguments" | "parameters": {...}} -> ToolCall; None if it is not such an object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = arguments_text(args)
    return None if text is None else ToolCall(name=obj["name"], arguments=text)


def decode_json_values(text: str) -> Optional[list[Any]]:
    """Every JSON value in text, separated by whitespace, ';' or ','; None if anything else is there."""
    decoder = json.JSONDecoder()
    values, i, n = [], 0, len(text)
    while True:
        while i < n and (text[i].isspace() or text[i] in ";,"):
            i += 1
        if i >= n:
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


class ToolParser:
    name = "base"
    # Strings that, seen in the output, mean a tool call may follow: streaming holds text back from there.
    start_markers: tuple[str, ...] = ()
    # Only at the very start of the output (after whitespace)?
    markers_at_start_only = False

    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        self.tool_names = {t["function"]["name"] for t in (tools or []) if isinstance(t.get("function"), dict)}

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            calls, content = self._extract(text)
        except Exception:  # noqa: BLE001 - malformed model output is content, never an error
            calls, content = None, text
        if not calls or (self.tool_names and any(c.name not in self.tool_names for c in calls)):
            return ExtractedToolCalls(content=text, tool_calls=[])
        # The text before the calls, whitespace kept, is what streaming sends as it comes (as vLLM's parsers answer);
        # whitespace alone is no content.
        return ExtractedToolCalls(content=content if content and content.strip() else None, tool_calls=calls)

    def _extract(self, text: str) -> tuple[Optional[list[ToolCall]], Optional[str]]:
        """(calls or None, the text before the calls, unstripped)."""
        raise NotImplementedError

    def stream_reader(self) -> Any:
        """A streaming.CallReader that reads this format's calls as they are generated (fed from the first start
        marker, or the answer's start for markers_at_start_only), or None: the calls then go out whole at the end."""
        return None
