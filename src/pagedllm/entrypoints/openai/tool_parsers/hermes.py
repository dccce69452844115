"""Hermes / Qwen2.5 / Qwen3 format: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, repeated."""
from __future__ import annotations

import json
import re
from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser, call_from_object
from pagedllm.entrypoints.openai.tool_parsers.streaming import HermesCallReader

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = ("<tool_call>",)

    def _extract(self, text: str) -> tuple[Optional[list[ToolCall]], Optional[str]]:
        start = text.find("<tool_call>")
        if start < 0:
            return None, text
        calls = []
        for body in _CALL.findall(text[start:]):
            call = call_from_object(json.loads(body))
            if call is None:
                return None, text
            calls.append(call)
        return calls, text[:start]

    def stream_reader(self) -> HermesCallReader:
        return HermesCallReader()
