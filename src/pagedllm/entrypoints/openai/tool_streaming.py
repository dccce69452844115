"""Streaming with tools: one ToolCallStreamer per choice turns text deltas into OpenAI chunk deltas.

Content streams as it comes until a parser's start marker may have begun (a suffix that could grow into
"<tool_call>" is held back, and leading whitespace until something else comes); from the marker on the text is
held and parsed at the end, then each call goes out as one delta carrying id, name and the whole arguments, which
the OpenAI SDK accumulates into the same call as the non-streamed response. The content deltas add up to the
non-streamed message.content. A named tool choice streams its arguments as they are generated.
"""
from __future__ import annotations

from typing import Optional

from pagedllm.entrypoints.openai.tool_calling import ToolPlan, extract_tool_calls, finish_reason_with_tools


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                best = max(best, k)
                break
    return best


class ToolCallStreamer:
    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text already sent as content
        self.holding = False  # a tool call may have started: hold everything from `sent` on
        self.call_id = plan.call_id()
        self.named_started = False

    def feed(self, delta: str) -> list[dict]:
        if not delta:
            return []
        self.text += delta
        mode = self.plan.mode
        if mode == "none":
            self.sent = len(self.text)
            return [{"content": delta}]
        if mode == "named":
            out = []
            if not self.named_started:
                self.named_started = True
                out.append({"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                            "function": {"name": self.plan.named, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            self.sent = len(self.text)
            return out
        if mode == "required" or self.holding:
            return []
        return self._auto_content()

    def _auto_content(self) -> list[dict]:
        parser = self.plan.parser
        markers = parser.start_markers
        if parser.markers_at_start_only:
            head = self.text.lstrip()
            if not head:
                return []
            if any(head.startswith(m) for m in markers):
                self.holding = True
                return []
            if any(m.startswith(head) for m in markers):
                return []  # ("<" may grow into "<|python_tag|>" or not: wait, but commit to holding only on a marker)
            return self._send_upto(len(self.text))
        positions = [p for p in (self.text.find(m, self.sent) for m in markers) if p >= 0]
        if positions:
            self.holding = True
            end = min(positions)
        else:
            end = len(self.text) - _held_suffix(self.text, markers)
        if self.sent == 0 and not self.text[:end].strip():
            return []  # whitespace alone before a call is no content (the parser's rule): wait for more
        return self._send_upto(end)

    def _send_upto(self, end: int) -> list[dict]:
        if end <= self.sent:
            return []
        piece = self.text[self.sent:end]
        self.sent = end
        return [{"content": piece}]

    def finish(self, finish_reason: Optional[str]) -> tuple[list[dict], Optional[str]]:
        """The last deltas of the choice and its finish_reason."""
        mode = self.plan.mode
        if mode == "none":
            return [], finish_reason
        if mode == "named":
            if not self.named_started:
                return [], finish_reason
            return [], finish_reason_with_tools(extract_tool_calls(self.plan, self.text, finish_reason), finish_reason)
        result = extract_tool_calls(self.plan, self.text, finish_reason)
        if not result.called:
            return self._send_upto(len(self.text)), finish_reason
        out = []
        # The content sent so far is a prefix of the parsed content (the text before the first call); the rest
        # of it goes out now, so the deltas add up to the non-streamed message.content.
        content = result.content or ""
        if len(content) > self.sent and content.startswith(self.text[:self.sent]):
            out.append({"content": content[self.sent:]})
        for i, call in enumerate(result.tool_calls):
            out.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": call.arguments}}]})
        return out, finish_reason_with_tools(result, finish_reason)
