"""Incremental tool-call streaming (tool_choice "auto", stream true), at the parser level, fed deltas split the way
tokens split text (one character, whole words, a marker cut in two): a call's first delta carries index, id, type
and name with arguments "", later ones the index and pieces of the arguments as they are generated; the pieces
add up to the non-streamed arguments; markers never reach the content."""
from __future__ import annotations

import json
import re

import pytest

from pagedllm.entrypoints.openai.tool_calling import extract_tool_calls, finish_reason_with_tools, plan_tools
from pagedllm.entrypoints.openai.tool_parsers.streaming import JsonCanonicalizer
from pagedllm.entrypoints.openai.tool_streaming import ToolCallStreamer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]

_JSON_VALUES = [
    '{}', '{ }', '[]', '{"a": 1}', '{"a":1,"b":[1,2.5,-3e2,1E400,-0,0.0],"c":{"d":null,"e":true,"f":false}}',
    '{\n  "city" :\t"Par\\"is\\\\",  "note": "tab\\there\\nline\\u0041\\/"\n}',
    '{"emoji": "\\ud83d\\ude00 ok", "lone": "\\ud83d x", "raw": "São Paulo 東京 \u2028"}',
    '{"nested": [[], [{}], [{"x": [1, [2, [3]]]}]], "n": -12.50e-1, "big": 123456789012345678901234567890}',
    '{"ctl": "\\u0001\\u001f", "inf": Infinity, "neg": -Infinity, "nan": NaN}',
    '"just a string"', '[1, "two", {"three": 3}]',
]


def _splits(text: str, step: int) -> list[str]:
    return [text[i:i + step] for i in range(0, len(text), step)]


@pytest.mark.parametrize("raw", _JSON_VALUES)
@pytest.mark.parametrize("step", [1, 2, 3, 7, 10_000])
def test_canonicalizer_pieces_add_up_to_json_dumps(raw: str, step: int) -> None:
    """The canonical text, piece by piece, is json.dumps(json.loads(raw), ensure_ascii=False) exactly (what the
    non-streamed extraction sends), whatever the split; each piece is final (the text only grows)."""
    c = JsonCanonicalizer()
    seen = ""
    used = 0
    for piece in _splits(raw + " ", step):  # (a trailing space ends a bare top-level value)
        used += c.feed(piece)
        assert c.text().startswith(seen)
        seen = c.text()
    assert c.done and not c.error
    assert c.text() == json.dumps(json.loads(raw), ensure_ascii=False)
    assert raw[:used].strip() == raw.strip()


def test_canonicalizer_stops_at_the_values_end() -> None:
    c = JsonCanonicalizer()
    assert c.feed('{"a": [1]}  \n</tool_call>') == len('{"a": [1]}')
    assert c.done and c.text() == '{"a": [1]}'
    c = JsonCanonicalizer()
    assert c.feed("12,") == 2 and c.done and c.text() == "12"


@pytest.mark.parametrize("raw", ['{"a" 1}', '{"a": tru}', '{"a": 01}', '{a: 1}', '{"a": "x\x01"}', '{"a": 1]',
                                 '[1,, 2]', '{"a": "\\x"}', '{"a": "\\u12G4"}', "}"])
def test_canonicalizer_flags_what_json_loads_refuses(raw: str) -> None:
    c = JsonCanonicalizer()
    for ch in raw + " ":
        c.feed(ch)
    assert c.error
    with pytest.raises(ValueError):
        json.loads(raw)


def _accumulate(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What the OpenAI SDK's stream accumulation does with chat-chunk deltas."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.get("id") or slot["id"]
            fn = tc.get("function") or {}
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def _feed(plan, pieces: list[str], finish: str = "stop") -> tuple[list[list[dict]], list[dict], str]:
    """(deltas per piece, the end's deltas, finish reason)."""
    s = ToolCallStreamer(plan)
    per_piece = [s.feed(p) for p in pieces]
    last, reason = s.finish(finish)
    return per_piece, last, reason


def _words(text: str) -> list[str]:
    return re.findall(r"\s*\S+|\s+", text)


def _tokens(text: str) -> list[str]:
    """Roughly how a BPE tokenizer splits it: words, punctuation and the marker's pieces apart."""
    return re.findall(r"<|/|tool|_call|>|\w+|\s+|[^\w\s]", text)


_HERMES = ('Let me check both. <tool_call>\n{"name": "get_weather", "arguments": {"city": "São \\"Paulo\\"", '
           '"days": [1, 2.0, 3e1], "hourly": true}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
           '{}}\n</tool_call>')


def _splittings(text: str) -> dict[str, list[str]]:
    marker = text.find("<tool_call>")
    cut = [text[:marker + 5], text[marker + 5:]] if marker >= 0 else [text]  # the marker split across deltas
    return {"chars": list(text), "words": _words(text), "tokens": _tokens(text), "marker_cut": cut,
            "threes": _splits(text, 3), "whole": [text]}


@pytest.mark.parametrize("split", ["chars", "words", "tokens", "marker_cut", "threes", "whole"])
def test_hermes_calls_stream_incrementally_and_add_up(split: str) -> None:
    plan = plan_tools(TOOLS, "auto", None, "hermes", None)
    pieces = _splittings(_HERMES)[split]
    assert "".join(pieces) == _HERMES
    per_piece, last, reason = _feed(plan, pieces)
    deltas = [d for ds in per_piece for d in ds] + last
    full = extract_tool_calls(plan, _HERMES, "stop")
    content, calls = _accumulate(deltas)
    assert reason == "tool_calls" == finish_reason_with_tools(full, "stop")
    assert content == full.content == "Let me check both. "
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in full.tool_calls]
    assert all("<" not in (d.get("content") or "") for d in deltas)
    # the content comes first, then each call: a header (id, type, name, arguments ""), then argument pieces only
    first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert all("content" in d for d in deltas[:first_call])
    assert all("tool_calls" in d and "content" not in d for d in deltas[first_call:])
    tool_deltas = [d["tool_calls"][0] for d in deltas[first_call:]]
    headers = [t for t in tool_deltas if "id" in t]
    assert [(h["index"], h["type"], h["function"]) for h in headers] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "get_time", "arguments": ""})]
    assert all(h["id"].startswith("call_") for h in headers) and headers[0]["id"] != headers[1]["id"]
    assert all(set(t) == {"index", "function"} and set(t["function"]) == {"arguments"} for t in tool_deltas
               if "id" not in t)
    indexes = [t["index"] for t in tool_deltas]
    assert indexes == sorted(indexes)  # call 1 starts after call 0 ended
    if split in ("chars", "words", "tokens", "threes"):
        assert len([t for t in tool_deltas if t["index"] == 0 and "id" not in t]) > 3  # pieces, not one delta
    if split == "whole":
        assert last == []  # everything went out as the text came; the end has nothing left to add


def test_hermes_arguments_go_out_while_generated() -> None:
    """Pieces go out as soon as they are certain: a string's characters at once, a number when it ended."""
    s = ToolCallStreamer(plan_tools(TOOLS, "auto", None, "hermes", None))
    assert s.feed("Sure") == [{"content": "Sure"}]
    assert s.feed(" <tool") == [{"content": " "}]  # "<tool" may be the marker's start: held back
    assert s.feed("_call>") == []
    assert s.feed('{"name": "get_wea') == []  # the name is not complete yet
    (header,) = s.feed('ther", ')
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert s.feed('"arguments": {"city": "Pa') == [{"tool_calls": [{"index": 0, "function": {"arguments":
                                                                                              '{"city": "Pa'}}]}]
    assert s.feed('ris", "n": 1') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ris", "n": '}}]}]
    assert s.feed("2}") == [{"tool_calls": [{"index": 0, "function": {"arguments": "12}"}}]}]
    assert s.feed("}\n</tool_call>") == []
    assert s.finish("stop") == ([], "tool_calls")


def test_partial_marker_that_is_not_a_call_is_released_as_content() -> None:
    text = "a <tool but prose, and <tool_cal too"
    plan = plan_tools(TOOLS, "auto", None, "hermes", None)
    for pieces in (list(text), _words(text), _tokens(text)):
        per_piece, last, reason = _feed(plan, pieces)
        content, calls = _accumulate([d for ds in per_piece for d in ds] + last)
        assert (content, calls, reason) == (text, [], "stop")


@pytest.mark.parametrize("text, why", [
    ('<tool_call>\n{"name": "unknown_fn", "arguments": {"x": 1}}\n</tool_call>', "a function not offered"),
    ("<tool_call>{not json}</tool_call>", "no JSON"),
    ('<tool_call>["get_time"]</tool_call>', "no object"),
])
def test_what_is_no_call_sends_no_call_delta_and_ends_as_content(text: str, why: str) -> None:
    plan = plan_tools(TOOLS, "auto", None, "hermes", None)
    for pieces in (list(text), _tokens(text)):
        per_piece, last, reason = _feed(plan, pieces)
        assert not any("tool_calls" in d for ds in per_piece for d in ds), why
        assert _accumulate([d for ds in per_piece for d in ds] + last) == (text, []) and reason == "stop"


def test_arguments_given_as_a_json_string_or_left_out_go_out_at_the_end() -> None:
    """`"arguments": "{\\"city\\": ...}"` (JSON text in a string) becomes an object in the full parse: it is not
    streamed piece by piece (its canonical text differs), the end sends it; no arguments at all are "{}"."""
    text = ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\":\\"Oslo\\"}"}</tool_call>'
            '<tool_call>{"name": "get_time"}</tool_call>')
    plan = plan_tools(TOOLS, "auto", None, "hermes", None)
    per_piece, last, reason = _feed(plan, list(text))
    content, calls = _accumulate([d for ds in per_piece for d in ds] + last)
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    assert [d["tool_calls"][0]["function"]["arguments"] for d in last] == ['{"city": "Oslo"}', "{}"]
    assert content == "" and reason == "tool_calls"


def test_parallel_tool_calls_false_streams_the_first_call_only() -> None:
    plan = plan_tools(TOOLS, "auto", False, "hermes", None)
    per_piece, last, reason = _feed(plan, _tokens(_HERMES))
    deltas = [d for ds in per_piece for d in ds] + last
    assert {t["index"] for d in deltas for t in d.get("tool_calls", [])} == {0}
    full = extract_tool_calls(plan, _HERMES, "stop")
    assert [(c["name"], c["arguments"]) for c in _accumulate(deltas)[1]] == [(c.name, c.arguments)
                                                                             for c in full.tool_calls]


def test_cut_short_the_streamed_call_stays_and_finish_is_length() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Ber'
    plan = plan_tools(TOOLS, "auto", None, "hermes", None)
    per_piece, last, reason = _feed(plan, list(text), finish="length")
    content, calls = _accumulate([d for ds in per_piece for d in ds] + last)
    assert (content, reason, last) == ("", "length", [])
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Ber')]


@pytest.mark.parametrize("parser, text, content", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}', ""),
    ("llama3_json", '\n <|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                    '{"name": "get_time", "parameters": {}}<|eom_id|>', ""),
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}, '
                '{"name": "get_time", "arguments": {}}]', "Checking. "),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_time[ARGS]{}', ""),
    ("mistral", '[TOOL_CALLS]{"name": "get_time", "arguments": {}}', ""),
])
@pytest.mark.parametrize("split", ["chars", "tokens", "whole"])
def test_json_style_parsers_stream_incrementally(parser: str, text: str, content: str, split: str) -> None:
    plan = plan_tools(TOOLS, "auto", None, parser, None)
    pieces = {"chars": list(text), "tokens": _tokens(text), "whole": [text]}[split]
    per_piece, last, reason = _feed(plan, pieces)
    deltas = [d for ds in per_piece for d in ds]
    full = extract_tool_calls(plan, text, "stop")
    streamed_content, calls = _accumulate(deltas + last)
    assert full.called and reason == "tool_calls"
    assert streamed_content == content == (full.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in full.tool_calls]
    assert last == []  # every call and all its arguments went out while the text came
    headers = [t for d in deltas for t in d.get("tool_calls", []) if "id" in t]
    assert [h["index"] for h in headers] == list(range(len(full.tool_calls)))
    if parser == "mistral":  # (its templates want 9 alphanumeric ids back)
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", h["id"]) for h in headers)
    if split == "chars":
        assert sum(1 for d in deltas for t in d.get("tool_calls", []) if "id" not in t) > len(full.tool_calls)
    assert not any(m in streamed_content for m in ("[TOOL_CALLS]", "<|python_tag|>", "{"))


_QWEN_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}}}}}, TOOLS[1]]
_QWEN = ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n</function>\n"
         "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")


@pytest.mark.parametrize("split", ["chars", "tokens", "threes", "whole"])
def test_qwen3_coder_streams_a_parameter_at_a_time(split: str) -> None:
    """A parameter's value is known once it ended: the arguments go out as `{"city": ...`, `, "days": 3`, ...,
    `}`, each piece final; they add up to the non-streamed arguments."""
    plan = plan_tools(_QWEN_TOOLS, "auto", None, "qwen3_coder", None)
    pieces = {"chars": list(_QWEN), "tokens": _tokens(_QWEN), "threes": _splits(_QWEN, 3), "whole": [_QWEN]}[split]
    per_piece, last, reason = _feed(plan, pieces)
    deltas = [d for ds in per_piece for d in ds]
    full = extract_tool_calls(plan, _QWEN, "stop")
    content, calls = _accumulate(deltas + last)
    assert (content, reason, last) == ("I'll check.\n", "tool_calls", [])
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in full.tool_calls]
    args = [t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", []) if "id" not in t]
    if split == "chars":
        assert args == ['{"city": "São Paulo"', ', "days": 3', ', "opts": {"unit": "C"}', "}", "{}"]
    assert not any("<" in (d.get("content") or "") for d in deltas)


def test_qwen3_coder_call_left_open_is_finished_at_the_end() -> None:
    """No </parameter> nor </function> before the model stopped: the full parse still reads the call; what did not
    stream (the last value, the closing brace) goes out at the end."""
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n<parameter=city>\nOslo"
    plan = plan_tools(_QWEN_TOOLS, "auto", None, "qwen3_coder", None)
    per_piece, last, reason = _feed(plan, list(text))
    _, calls = _accumulate([d for ds in per_piece for d in ds] + last)
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"days": 2, "city": "Oslo"}')]
    assert [t["function"]["arguments"] for d in last for t in d["tool_calls"]] == [', "city": "Oslo"}']
    assert reason == "tool_calls"


@pytest.mark.parametrize("parser, text", [
    ("pythonic", '[get_weather(city="Bern"), get_time()]'),
    ("pythonic", '<|python_start|>[get_time()]<|python_end|>'),
])
def test_parsers_without_a_reader_send_each_call_whole_at_the_end(parser: str, text: str) -> None:
    plan = plan_tools(TOOLS, "auto", None, parser, None)
    per_piece, last, reason = _feed(plan, list(text))
    assert all(ds == [] for ds in per_piece)
    full = extract_tool_calls(plan, text, "stop")
    assert [d["tool_calls"][0]["function"] for d in last] == [{"name": c.name, "arguments": c.arguments}
                                                             for c in full.tool_calls]
    assert reason == "tool_calls"


def test_required_and_named_choices_stream_as_before() -> None:
    """"required" sends its calls at the end (its text is the JSON list), a named choice its arguments as they
    come: neither goes through a parser's reader."""
    required = plan_tools(TOOLS, "required", None, "hermes", None)
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    per_piece, last, reason = _feed(required, list(text))
    assert all(ds == [] for ds in per_piece) and reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in _accumulate(last)[1]] == [("get_weather", '{"city": "Oslo"}')]
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, "hermes", None)
    per_piece, last, reason = _feed(named, ['{"ci', 'ty": "Oslo"}'])
    assert per_piece[1] == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}]
    assert reason == "stop"
    assert _accumulate([d for ds in per_piece for d in ds])[1][0]["arguments"] == '{"city": "Oslo"}'


def test_a_call_whose_arguments_wait_for_the_end_holds_the_calls_after_it() -> None:
    """Each call's deltas come before the next call's header (the Responses API turns them into one item's events,
    in order): the calls after one whose arguments only the end can send wait for the end too."""
    text = ('<tool_call>{"name": "get_time"}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    per_piece, last, reason = _feed(plan_tools(TOOLS, "auto", None, "hermes", None), list(text))
    deltas = [d for ds in per_piece for d in ds] + last
    assert [t["index"] for d in deltas for t in d["tool_calls"]] == [0, 0, 1]
    assert [(c["name"], c["arguments"]) for c in _accumulate(deltas)[1]] == [("get_time", "{}"),
                                                                             ("get_weather", '{"city": "Oslo"}')]
