"""Qwen3-Coder's XML format (vLLM's `qwen3_coder`): text, then calls written as

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text (a newline after the opening tag and before the closing one is layout); they become
JSON by the type the tool's schema gives the parameter: strings as written, other types read as JSON ("null" is
null whatever the type), a value that does not read stays a string.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _value(raw: str, schema: Any) -> Any:
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    if raw.strip().lower() == "null":
        return None
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else [k for k in (kinds or []) if isinstance(k, str)]
    if not kinds or "string" in kinds:  # (no schema for it: as written, as vLLM)
        return raw
    text = raw.strip()
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return json.loads(text)
    except ValueError:
        return raw


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    start_markers = ("<tool_call>", "<function=")
    # No stream_reader (yet): the calls go out whole at the end. A parameter's JSON value depends on its end (the
    # newline before </parameter> is layout, "null" is null, non-string types are read once complete), so only
    # whole parameters could stream.

    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        super().__init__(tools)
        self.properties: dict[str, dict] = {}
        for t in tools or []:
            fn = t.get("function") if isinstance(t, dict) else None
            params = fn.get("parameters") if isinstance(fn, dict) else None
            props = params.get("properties") if isinstance(params, dict) else None
            if isinstance(props, dict):
                self.properties[fn["name"]] = props

    def _extract(self, text: str) -> tuple[Optional[list[ToolCall]], Optional[str]]:
        starts = [p for p in (text.find(m) for m in self.start_markers) if p >= 0]
        if not starts:
            return None, text
        start = min(starts)
        calls = []
        for function in _FUNCTION.finditer(text, start):
            name = function.group(1).strip()
            props = self.properties.get(name, {})
            args = {p.group(1).strip(): _value(p.group(2), props.get(p.group(1).strip()))
                    for p in _PARAMETER.finditer(function.group(2))}
            calls.append(ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False)))
        return (calls or None), text[:start]
