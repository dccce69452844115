"""Incremental reading of tool calls while they are generated (tool_choice "auto", stream true).

A parser's CallReader is fed the text from the point where a call may start and keeps a list of calls seen so
far, each with its name once that is complete and its arguments as far as they are known. The arguments are
the canonical text json.dumps(json.loads(raw), ensure_ascii=False) that the non-streamed extraction gives, produced
piece by piece (JsonCanonicalizer): every piece is final, so the pieces add up to the non-streamed arguments.
(One exception no streaming can avoid: a duplicated key, whose last value json.loads keeps at the first's place.)
"""
from __future__ import annotations

import json
from typing import Optional

_WS = " \t\n\r"  # JSON's whitespace (json.loads takes no other)
_BARE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-.")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _canonical_char(ch: str) -> str:
    """ch as json.dumps(..., ensure_ascii=False) writes it inside a string."""
    if ch >= " " and ch not in '"\\':
        return ch
    return json.dumps(ch, ensure_ascii=False)[1:-1]


class JsonCanonicalizer:
    """One JSON value's raw text in, pieces of its canonical text (json.dumps(json.loads(raw), ensure_ascii=False))
    out as soon as they are certain: a string's characters one by one, a number or literal once it ended (1.0e1 is
    10.0: its text is known only then). feed() returns how many characters of the chunk belong to the value (all
    until the value ends); `done` once it ended, `error` where the text is no JSON (json.loads would refuse it)."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.stack: list[str] = []  # "{" / "[" of the containers open
        self.expect = "value"  # value | value_or_end | key | key_or_end | colon | comma_or_end
        self.in_string = False
        self.string_is_key = False
        self.escape: Optional[str] = None  # after a backslash: the escape's characters so far
        self.high_surrogate: Optional[str] = None  # a \uD8xx escape waiting for its \uDCxx pair
        self.bare: Optional[str] = None  # a number / true / false / null / NaN / Infinity being read
        self.done = False
        self.error = False
        self.bare_ended_here = False  # a top-level number ended at a character that is not its own

    def text(self) -> str:
        return "".join(self.out)

    def feed(self, chunk: str) -> int:
        for i, ch in enumerate(chunk):
            if self.done or self.error:
                return i
            self._char(ch)
            if self.done and self.bare_ended_here:
                return i  # the character that ended a top-level number is not the value's
        return len(chunk)

    def _emit(self, piece: str) -> None:
        self.out.append(piece)

    def _value_ended(self) -> None:
        if self.stack:
            self.expect = "comma_or_end"
        else:
            self.done = True

    def _char(self, ch: str) -> None:
        if self.in_string:
            self._string_char(ch)
            return
        if self.bare is not None:
            if ch in _BARE:
                self.bare += ch
                return
            self._end_bare()
            if self.error or self.done:
                self.bare_ended_here = self.done
                return
        if ch in _WS:
            return
        expect = self.expect
        if expect in ("value", "value_or_end"):
            if expect == "value_or_end" and ch == "]":
                self._close("[")
            elif ch == "{":
                self.stack.append("{")
                self.expect = "key_or_end"
                self._emit("{")
            elif ch == "[":
                self.stack.append("[")
                self.expect = "value_or_end"
                self._emit("[")
            elif ch == '"':
                self.in_string, self.string_is_key = True, False
                self._emit('"')
            elif ch in _BARE:
                self.bare = ch
            else:
                self.error = True
        elif expect in ("key", "key_or_end"):
            if expect == "key_or_end" and ch == "}":
                self._close("{")
            elif ch == '"':
                self.in_string, self.string_is_key = True, True
                self._emit('"')
            else:
                self.error = True
        elif expect == "colon":
            if ch == ":":
                self.expect = "value"
                self._emit(": ")
            else:
                self.error = True
        else:  # comma_or_end
            if ch == ",":
                self.expect = "key" if self.stack[-1] == "{" else "value"
                self._emit(", ")
            elif ch in "]}":
                self._close("[" if ch == "]" else "{")
            else:
                self.error = True

    def _close(self, opener: str) -> None:
        if not self.stack or self.stack[-1] != opener:
            self.error = True
            return
        self.stack.pop()
        self._emit("]" if opener == "[" else "}")
        self._value_ended()

    def _end_bare(self) -> None:
        text, self.bare = self.bare, None
        try:
            value = json.loads(text)
        except ValueError:
            self.error = True
            return
        if isinstance(value, (dict, list, str)):  # (cannot be: bare characters only)
            self.error = True
            return
        self._emit(json.dumps(value))
        self._value_ended()

    def _string_char(self, ch: str) -> None:
        if self.escape is not None:
            self.escape += ch
            if self.escape[0] == "u":
                if len(self.escape) < 5:
                    if len(self.escape) > 1 and ch not in "0123456789abcdefABCDEF":
                        self.error = True
                    return
                decoded = chr(int(self.escape[1:], 16))
                self.escape = None
                self._decoded(decoded, from_u_escape=True)
            elif self.escape in _SIMPLE_ESCAPES:
                decoded = _SIMPLE_ESCAPES[self.escape]
                self.escape = None
                self._decoded(decoded)
            else:
                self.error = True
            return
        if ch == "\\":
            self.escape = ""
        elif ch == '"':
            self._flush_surrogate()
            self.in_string = False
            self._emit('"')
            if self.string_is_key:
                self.expect = "colon"
            else:
                self._value_ended()
        elif ch < " ":  # json.loads (strict) refuses raw control characters in strings
            self.error = True
        else:
            self._decoded(ch)

    def _decoded(self, ch: str, from_u_escape: bool = False) -> None:
        # json.loads joins \uD83D\uDE00 into one character; a high surrogate waits to see what follows it.
        if self.high_surrogate is not None:
            high, self.high_surrogate = self.high_surrogate, None
            if from_u_escape and "\udc00" <= ch <= "\udfff":
                self._emit(_canonical_char(chr(0x10000 + ((ord(high) - 0xD800) << 10) + (ord(ch) - 0xDC00))))
                return
            self._emit(_canonical_char(high))
        if from_u_escape and "\ud800" <= ch <= "\udbff":
            self.high_surrogate = ch
            return
        self._emit(_canonical_char(ch))

    def _flush_surrogate(self) -> None:
        if self.high_surrogate is not None:
            self._emit(_canonical_char(self.high_surrogate))
            self.high_surrogate = None


class StreamedCall:
    """One call as far as it was read: name (None until complete), arguments' canonical text so far."""

    name: Optional[str] = None
    streamable = True  # False: the arguments are not streamed (a JSON string of JSON, ...): the end sends them
    args: Optional[JsonCanonicalizer] = None
    taken = 0  # pieces of args.out already taken

    @property
    def complete(self) -> bool:
        """Read to its end with all its arguments streamed: the next call may start (a client, or the Responses
        API's events, sees one call's deltas after another's, never interleaved)."""
        return self.streamable and self.args is not None and self.args.done

    @property
    def arguments(self) -> str:
        return self.args.text() if self.args is not None else ""

    def pieces(self) -> list[str]:
        return self.args.out if self.args is not None else []

    def take(self) -> str:
        """The arguments' text added since the last take (no re-joining of all of it: arguments may be long)."""
        pieces = self.pieces()
        if self.taken == len(pieces):
            return ""
        piece = "".join(pieces[self.taken:])
        self.taken = len(pieces)
        return piece


class PiecesCall(StreamedCall):
    """A call whose reader writes the arguments' canonical text itself, piece by piece (qwen3_coder's parameters)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.out: list[str] = []
        self.closed = False  # its reader wrote the closing brace

    @property
    def complete(self) -> bool:
        return self.closed and self.streamable

    @property
    def arguments(self) -> str:
        return "".join(self.out)

    def pieces(self) -> list[str]:
        return self.out


class ObjectCall(StreamedCall):
    """A call written as a JSON object {"name": ..., "arguments" | "parameters": {...}} (hermes, llama3_json,
    mistral's JSON form), read character by character; other keys are skipped."""

    def __init__(self) -> None:
        self.done = False
        self.error = False
        self.started = False  # the opening "{" was read
        self.expect = "key_or_end"  # key_or_end | key | colon | value | comma_or_end
        self.key: Optional[JsonCanonicalizer] = None
        self.key_text = ""
        self.value: Optional[JsonCanonicalizer] = None
        self.value_key = ""
        self.args: Optional[JsonCanonicalizer] = None

    def feed(self, chunk: str) -> int:
        """Characters of chunk that belong to the object (all until it ends)."""
        i, n = 0, len(chunk)
        while i < n and not (self.done or self.error):
            if not self.started:
                ch = chunk[i]
                i += 1
                if ch in _WS:
                    continue
                self.started, self.error = True, ch != "{"
                continue
            if self.key is not None:
                i += self.key.feed(chunk[i:])
                if self.key.error:
                    self.error = True
                elif self.key.done:
                    self.key_text, self.key = json.loads(self.key.text()), None
                    self.expect = "colon"
                continue
            if self.value is not None:
                i += self.value.feed(chunk[i:])
                if self.value.error:
                    self.error = True
                elif self.value.done:
                    self._value_done(self.value)
                    self.value = None
                    self.expect = "comma_or_end"
                continue
            ch = chunk[i]
            if ch in _WS:
                i += 1
            elif self.expect in ("key", "key_or_end"):
                if ch == "}" and self.expect == "key_or_end":
                    self.done = True
                    i += 1
                elif ch == '"':
                    self.key = JsonCanonicalizer()
                else:
                    self.error = True
            elif self.expect == "colon":
                self.error = ch != ":"
                self.expect = "value"
                i += 1
            elif self.expect == "value":
                self.value = JsonCanonicalizer()
                if self.key_text in ("arguments", "parameters"):
                    # (the first of the two is streamed; a second one stops the streaming of these arguments)
                    if self.args is None and ch == "{":
                        self.args = self.value
                    else:
                        self.streamable = False  # JSON text in a string, or a second arguments: the end sends them
                self.value_key = self.key_text
            else:  # comma_or_end
                i += 1
                if ch == ",":
                    self.expect = "key"
                elif ch == "}":
                    self.done = True
                else:
                    self.error = True
        return i

    def _value_done(self, value: JsonCanonicalizer) -> None:
        if self.value_key == "name" and self.name is None:
            name = json.loads(value.text())
            if isinstance(name, str) and name:
                self.name = name
            else:
                self.error = True


class NamedArgsCall(StreamedCall):
    """Mistral's v11 form `name[ARGS]{...}`: the name is known, the arguments are one JSON object."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.args = JsonCanonicalizer()
        self.started = False

    @property
    def done(self) -> bool:
        return self.args.done

    @property
    def error(self) -> bool:
        return self.args.error

    def feed(self, chunk: str) -> int:
        i = 0
        if not self.started:
            while i < len(chunk) and chunk[i] in _WS:
                i += 1
            if i == len(chunk):
                return i
            self.started = True
            if chunk[i] != "{":
                self.args.error = True
                return i
        return i + self.args.feed(chunk[i:])


class CallReader:
    """Fed the text from where a call may start (the parser's marker, or the answer's start), in pieces; `calls`
    grows as calls appear. `failed`: the text stopped looking like this format's calls; nothing more is read (what
    went out stays; the end's non-streamed extraction decides the rest)."""

    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0
        self.calls: list[StreamedCall] = []
        self.current = None
        self.failed = False
        self.state = "start"

    def feed(self, text: str) -> None:
        self.buf += text
        while not self.failed and self._step():
            pass

    def _skip(self, chars: str = _WS) -> bool:
        """Skip chars; whether there is more text after them."""
        while self.pos < len(self.buf) and self.buf[self.pos] in chars:
            self.pos += 1
        return self.pos < len(self.buf)

    def _seek(self, marker: str) -> bool:
        """Move pos past the next marker (True), or, not there yet, up to the tail that may still grow into it."""
        i = self.buf.find(marker, self.pos)
        if i < 0:
            self.pos = max(self.pos, len(self.buf) - len(marker) + 1)
            return False
        self.pos = i + len(marker)
        return True

    def _marker(self, marker: str) -> Optional[bool]:
        """At pos: True (and skipped) if marker is there, None if the text so far may still become it, else False."""
        rest = self.buf[self.pos:self.pos + len(marker)]
        if rest == marker:
            self.pos += len(marker)
            return True
        return None if marker.startswith(rest) else False

    def _feed_current(self) -> bool:
        """Feed the call being read; True when it ended (well-formed), False when it needs more text."""
        call = self.current
        self.pos += call.feed(self.buf[self.pos:])
        if call.error:
            self.failed = True
            return False
        if call.done:
            self.current = None
            return True
        return False

    def _start_call(self, call: StreamedCall) -> None:
        self.current = call
        self.calls.append(call)

    def _step(self) -> bool:
        """Advance; False when more text is needed."""
        raise NotImplementedError


class HermesCallReader(CallReader):
    """`<tool_call>` JSON object `</tool_call>`, repeated; text between calls is dropped (as the full parse does)."""

    START, END = "<tool_call>", "</tool_call>"

    def _step(self) -> bool:
        if self.state in ("start", "seek"):
            if not self._seek(self.START):
                return False
            self.state = "body"
            return True
        if self.state == "body":
            if self.current is None:
                if not self._skip():
                    return False
                self._start_call(ObjectCall())
            if not self._feed_current():
                return False
            self.state = "close"
            return True
        # close: the object is the whole body (json.loads of it), only whitespace before </tool_call>
        if not self._skip():
            return False
        found = self._marker(self.END)
        if found is None:
            return False
        if found is False:
            self.failed = True
            return False
        self.state = "seek"
        return True


class JsonListCallReader(CallReader):
    """JSON call objects after an optional prefix token, separated by whitespace, ";" or "," (llama3_json:
    `<|python_tag|>`{...}; {...}, ending in an optional `<|eom_id|>`). With arrays: mistral's
    `[TOOL_CALLS][{...}, {...}]`, `[TOOL_CALLS]{...}` and the v11 `[TOOL_CALLS]name[ARGS]{...}`, repeated."""

    def __init__(self, prefix: str, end: Optional[str] = None, arrays: bool = False) -> None:
        super().__init__()
        self.prefix, self.end, self.arrays = prefix, end, arrays
        self.in_array = False

    def _step(self) -> bool:
        if self.current is not None:
            if not self._feed_current():
                return False
            self.state = "values"
            return True
        if self.state == "start":
            if not self._skip():
                return False
            found = self._marker(self.prefix)
            if found is None:
                return False
            if self.arrays and not found:  # (mistral's reader starts at its marker)
                self.failed = True
                return False
            self.state = "after_prefix" if self.arrays else "values"
            return True
        if self.state == "after_prefix" and self.arrays:
            # after [TOOL_CALLS]: JSON values, or the v11 form name[ARGS]
            if not self._skip():
                return False
            if self.buf[self.pos] not in "[{":
                j = self.buf.find("[ARGS]", self.pos)
                if j < 0:
                    return False
                name = self.buf[self.pos:j].strip()
                if not name or self.prefix in name:
                    self.failed = True
                    return False
                self.pos = j + len("[ARGS]")
                self._start_call(NamedArgsCall(name))
                return True
            self.state = "values"
            return True
        # values
        if not self._skip(_WS + (";," if not self.in_array else ",")):
            return False
        ch = self.buf[self.pos]
        if ch == "{":
            self._start_call(ObjectCall())
            return True
        if self.arrays and not self.in_array:
            found = self._marker(self.prefix)  # (before arrays: "[" may be the marker's start)
            if found is None:
                return False
            if found:
                self.state = "after_prefix"
                return True
            if ch == "[":
                self.in_array = True
                self.pos += 1
                return True
        if self.in_array and ch == "]":
            self.in_array = False
            self.pos += 1
            return True
        if self.end and not self.in_array:
            found = self._marker(self.end)
            if found is None:
                return False
            if found:
                self.state = "ended"
                self.failed = True  # nothing may follow: read no more
                return False
        self.failed = True
        return False
