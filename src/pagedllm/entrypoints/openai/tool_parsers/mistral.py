"""Mistral format: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the v11 tokenizer's
`[TOOL_CALLS]name[ARGS]{...}` repeated; text before the marker is content."""
from __future__ import annotations

import json
from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ToolCall,
    ToolParser,
    arguments_text,
    call_from_object,
    decode_json_values,
)
from pagedllm.entrypoints.openai.tool_parsers.streaming import JsonListCallReader

_MARK = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = (_MARK,)

    def _extract(self, text: str) -> tuple[Optional[list[ToolCall]], Optional[str]]:
        start = text.find(_MARK)
        if start < 0:
            return None, text
        parts = [p.strip() for p in text[start:].split(_MARK) if p.strip()]
        calls: list[ToolCall] = []
        for part in parts:
            found = self._part(part)
            if found is None:
                return None, text
            calls.extend(found)
        return calls, text[:start]

    @staticmethod
    def _part(part: str) -> Optional[list[ToolCall]]:
        if "[ARGS]" in part and not part.startswith(("[", "{")):
            name, _, args = part.partition("[ARGS]")
            value, _ = json.JSONDecoder().raw_decode(args.strip())
            text = arguments_text(value)
            return None if text is None or not name.strip() else [ToolCall(name=name.strip(), arguments=text)]
        values = decode_json_values(part)
        if not values:
            return None
        objects = [o for v in values for o in (v if isinstance(v, list) else [v])]
        calls = [call_from_object(o) for o in objects]
        return None if not calls or any(c is None for c in calls) else calls

    def stream_reader(self) -> JsonListCallReader:
        return JsonListCallReader(_MARK, arrays=True)
