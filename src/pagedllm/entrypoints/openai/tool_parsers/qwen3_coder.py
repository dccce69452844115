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
from pagedllm.entrypoints.openai.tool_parsers.streaming import CallReader, PiecesCall

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

    def stream_reader(self) -> "Qwen3CoderCallReader":
        return Qwen3CoderCallReader(self.properties)


class Qwen3CoderCallReader(CallReader):
    """The calls as _extract reads them, a parameter at a time (as vLLM's qwen3_coder streams them): its JSON value
    is known only once it ended (the newline before </parameter> is layout, "null" is null, other types are read
    whole), so the arguments go out as `{"k": v`, `, "k2": v2`, ..., `}` at </function>."""

    FUNCTION, PARAMETER, END_PARAMETER, END_FUNCTION = "<function=", "<parameter=", "</parameter>", "</function>"

    def __init__(self, properties: dict[str, dict]) -> None:
        super().__init__()
        self.properties = properties
        self.state = "seek"
        self.key = ""
        self.keys: set[str] = set()  # the current call's parameters so far
        self.value_start = 0

    def _name_end(self) -> Optional[int]:
        """Where the name from pos ends (its ">"), -1 if a newline comes first (no tag), None if not yet known."""
        gt, nl = self.buf.find(">", self.pos), self.buf.find("\n", self.pos)
        if gt < 0 and nl < 0:
            return None
        return gt if gt >= 0 and (nl < 0 or gt < nl) and gt > self.pos else -1

    def _step(self) -> bool:
        call = self.current
        if self.state == "seek":
            if not self._seek(self.FUNCTION):
                return False
            self.state = "name"
            return True
        if self.state in ("name", "key"):
            end = self._name_end()
            if end is None:
                return False
            if end < 0:  # ("<function=\n": no tag, as the regex reads it; search on)
                self.state = "seek" if self.state == "name" else "body"
                return True
            name, self.pos = self.buf[self.pos:end].strip(), end + 1
            if self.state == "name":
                self._start_call(PiecesCall(name))
                self.keys, self.state = set(), "body"
            else:
                self.key, self.value_start, self.state = name, self.pos, "value"
            return True
        if self.state == "body":
            found = [(i, m) for m in (self.PARAMETER, self.END_FUNCTION) if (i := self.buf.find(m, self.pos)) >= 0]
            if not found:
                return False
            i, marker = min(found)
            self.pos = i + len(marker)
            if marker == self.PARAMETER:
                self.state = "key"
            else:
                call.out.append("}" if call.out else "{}")
                call.closed = True
                self.current, self.state = None, "seek"
            return True
        # value: it ends at </parameter>, the next <parameter= or </function>, as _PARAMETER reads the body
        ends = [(i, m) for m in (self.END_PARAMETER, self.PARAMETER, self.END_FUNCTION)
                if (i := self.buf.find(m, self.value_start)) >= 0]
        if not ends:
            return False
        end, marker = min(ends)
        props = self.properties.get(call.name, {})
        value = _value(self.buf[self.value_start:end], props.get(self.key))
        if self.key in self.keys:
            call.streamable = False  # a repeated parameter: the dict keeps its last value at its first place
        self.keys.add(self.key)
        call.out.append(("{" if not call.out else ", ") + json.dumps(self.key, ensure_ascii=False) + ": "
                        + json.dumps(value, ensure_ascii=False))
        self.pos = end + len(marker) if marker == self.END_PARAMETER else end
        self.state = "body"
        return True
