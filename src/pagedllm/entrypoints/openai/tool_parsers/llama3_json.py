"""Llama 3.1 / 3.2 JSON format: `<|python_tag|>`? then `{"name": ..., "parameters": {...}}`, several joined by ';'."""
from __future__ import annotations

from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser, call_from_object, decode_json_values
from pagedllm.entrypoints.openai.tool_parsers.streaming import JsonListCallReader


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = ("<|python_tag|>", "{")
    markers_at_start_only = True

    def _extract(self, text: str) -> tuple[Optional[list[ToolCall]], Optional[str]]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if body.endswith("<|eom_id|>"):
            body = body[:-len("<|eom_id|>")].strip()
        if not body.startswith("{"):
            return None, text
        values = decode_json_values(body)
        if not values:
            return None, text
        calls = [call_from_object(v) for v in values]
        if any(c is None for c in calls):
            return None, text
        return calls, None

    def stream_reader(self) -> JsonListCallReader:
        return JsonListCallReader("<|python_tag|>", end="<|eom_id|>")
