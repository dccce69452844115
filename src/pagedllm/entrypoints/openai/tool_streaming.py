"""Streaming with tools: one ToolCallStreamer per choice turns text deltas into OpenAI chunk deltas.

Content streams as it comes until a parser's start marker may have begun (a suffix that could grow into
"<tool_call>" is held back, and leading whitespace until something else comes); from the marker on nothing is
content. Parsers with a stream_reader (hermes, llama3_json, mistral; qwen3_coder a parameter at a time) then
stream each call as vLLM does: a first delta with index, id, type and name (arguments "") once the name is complete
(and offered), then pieces of the arguments as they are generated, in the canonical JSON text the non-streamed
answer gives (tool_parsers/streaming.py). At the end the non-streamed extraction is the reference: what the pieces
did not send yet goes out then (arguments given as a JSON string, a call left open), so the deltas, accumulated as
the OpenAI SDK does, equal the non-streamed answer. Pythonic calls go out as one delta each at the end (see its
parser). The content deltas add up to the non-streamed message.content. A named tool choice streams its arguments
as they are generated; "required" sends its calls at the end.
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
        self.reader = None  # the parser's CallReader, from the moment a call may have begun
        self.read = 0  # characters of text fed to the reader
        self.streamed: list[list[str]] = []  # per call sent: [name, arguments sent]

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
        if mode == "required":
            return []
        out = [] if self.holding else self._auto_content()
        if self.holding:
            out += self._auto_calls()
        return out

    def _start_holding(self, at: int) -> None:
        """A call may begin at text[at]: what follows is never content; the parser's reader (if any) reads it."""
        self.holding = True
        self.reader = self.plan.parser.stream_reader()
        self.read = at

    def _auto_calls(self) -> list[dict]:
        """The deltas of the calls the reader has seen grow since the last feed."""
        if self.reader is None:
            return []
        if not self.reader.failed:
            self.reader.feed(self.text[self.read:])
        self.read = len(self.text)
        names = self.plan.parser.tool_names
        out = []
        for i, call in enumerate(self.reader.calls):
            if i >= 1 and not self.plan.parallel:
                break  # (parallel_tool_calls false: the first call only, as the non-streamed answer)
            if i == len(self.streamed):
                if call.name is None or (names and call.name not in names):
                    break  # a name not yet complete, or one not offered (the end decides): later calls wait too
                if i and not self.reader.calls[i - 1].complete:
                    break  # the call before is not all out (arguments the end sends): no interleaving of calls
                self.streamed.append([call.name, ""])
                out.append({"tool_calls": [{"index": i, "id": self.plan.call_id(), "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            if call.streamable:
                piece = call.take()
                if piece:
                    out.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                    self.streamed[i][1] += piece
        return out

    def _auto_content(self) -> list[dict]:
        parser = self.plan.parser
        markers = parser.start_markers
        if parser.markers_at_start_only:
            head = self.text.lstrip()
            if not head:
                return []
            if any(head.startswith(m) for m in markers):
                self._start_holding(0)
                return []
            if any(m.startswith(head) for m in markers):
                return []  # ("<" may grow into "<|python_tag|>" or not: wait, but commit to holding only on a marker)
            return self._send_upto(len(self.text))
        positions = [p for p in (self.text.find(m, self.sent) for m in markers) if p >= 0]
        if positions:
            end = min(positions)
            self._start_holding(end)
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
            if self.streamed:
                # Calls went out that the full parse does not confirm (cut short by max_tokens, which answers the
                # text as content unstreamed, or malformed after its start): deltas cannot be taken back, and the
                # raw call text as content as well would only duplicate them. The finish reason stays.
                return [], finish_reason
            return self._send_upto(len(self.text)), finish_reason
        out = []
        # The content sent so far is a prefix of the parsed content (the text before the first call); the rest
        # of it goes out now, so the deltas add up to the non-streamed message.content.
        content = result.content or ""
        if len(content) > self.sent and content.startswith(self.text[:self.sent]):
            out.append({"content": content[self.sent:]})
        for i, call in enumerate(result.tool_calls):
            if i < len(self.streamed):
                # Streamed already: the rest of its arguments ("{}" for none, a JSON string's object, the tail a
                # reader did not stream). A call that does not match what went out (a duplicated key) stays as sent.
                name, sent = self.streamed[i]
                if name == call.name and len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                    out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments[len(sent):]}}]})
                continue
            out.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": call.arguments}}]})
        return out, finish_reason_with_tools(result, finish_reason)
