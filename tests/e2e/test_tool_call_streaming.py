"""Incremental tool-call streaming through `pagedllm serve` (SmolLM2), tool_choice "auto": a regex makes the model
write hermes calls (it would not on its own), raw HTTP and the openai SDK read the stream; the calls stream as vLLM's
do and reassemble to the non-streamed answer. Parser-level splits: tests/structured/test_tool_call_streaming.py."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="these tests call the server with the openai SDK")

from e2e_helpers import API_KEY, SERVED_NAME, Server  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}}}}]
TEXT = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, France", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')


def _literal_regex(text: str) -> str:
    return "".join("\\" + ch if ch in "\\^$.|?*+()[]{}" else "\\n" if ch == "\n" else ch for ch in text)


BODY = {"model": SERVED_NAME, "temperature": 0, "max_tokens": 120, "tools": TOOLS, "tool_choice": "auto",
        "messages": [{"role": "user", "content": "Weather and time in Paris?"}], "guided_regex": _literal_regex(TEXT)}


def _sse(server: Server, body: dict) -> list[dict]:
    chunks = []
    with server.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_auto_tool_calls_stream_incrementally_and_reassemble(server: Server) -> None:
    with server.client() as http:
        full = http.post("/v1/chat/completions", json=BODY).json()
    message = full["choices"][0]["message"]
    assert full["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "Sure.\n"
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert expected == [("get_weather", '{"city": "Paris, France", "unit": "celsius"}'),
                        ("get_time", '{"tz": "Europe/Paris"}')]

    chunks = _sse(server, dict(BODY, stream=True, stream_options={"include_usage": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Sure.\n"
    first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert not any(d.get("content") for d in deltas[first_call:])  # no text (markers included) after a call began
    calls: dict[int, list] = {}
    for d in deltas[first_call:]:
        for tc in d.get("tool_calls") or []:
            if tc["index"] not in calls:  # a call's first delta: id, type, name, no arguments yet
                assert tc["id"] and tc["type"] == "function" and tc["function"] == {
                    "name": tc["function"]["name"], "arguments": ""}
                calls[tc["index"]] = [tc["function"]["name"], []]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]][1].append(tc["function"]["arguments"])
    assert sorted(calls) == [0, 1]
    assert [(calls[i][0], "".join(calls[i][1])) for i in (0, 1)] == expected
    assert len(calls[0][1]) > 3  # the arguments came in pieces, as generated, not in one delta at the end
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls"]
    assert chunks[-1]["usage"] == full["usage"]


def test_openai_sdk_accumulates_the_streamed_calls(server: Server) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    kw = {k: v for k, v in BODY.items() if k != "guided_regex"}
    kw["extra_body"] = {"guided_regex": BODY["guided_regex"]}
    full = client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == full.finish_reason == "tool_calls"
    assert final.message.content == full.message.content
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in full.message.tool_calls]
    assert [json.loads(c.function.arguments) for c in final.message.tool_calls] == [
        {"city": "Paris, France", "unit": "celsius"}, {"tz": "Europe/Paris"}]
