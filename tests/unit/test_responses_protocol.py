"""The Responses request's translation into the chat request (entrypoints/openai/responses_protocol.py) and the
stream's events from made-up engine outputs (responses.py); the endpoint itself runs against a real server in
tests/e2e/test_responses_api.py."""
from __future__ import annotations

import json
from typing import Optional

import pytest

pytest.importorskip("fastapi", reason="the OpenAI server's modules need fastapi")

from pagedllm.entrypoints.openai.errors import APIError  # noqa: E402
from pagedllm.entrypoints.openai.responses_protocol import (ResponsesRequest, check_refused,  # noqa: E402
                                                            text_format_spec, to_chat_request)


def _chat(**kw):
    return to_chat_request(ResponsesRequest(**kw))


def _conv(**kw) -> list[tuple]:
    return [(m.role, m.content, m.tool_calls, m.tool_call_id) for m in _chat(**kw).messages]


def test_string_input_and_instructions() -> None:
    assert _conv(input="Hi") == [("user", "Hi", None, None)]
    assert _conv(input="Hi", instructions="Be brief.") == [("system", "Be brief.", None, None),
                                                          ("user", "Hi", None, None)]


def test_items_become_messages() -> None:
    items = [{"role": "developer", "content": "Rules."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                              {"type": "input_text", "text": "b"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]
    assert _conv(input=items) == [("system", "Rules.", None, None), ("user", "a\nb", None, None),
                                  ("assistant", "ok", None, None), ("assistant", None, calls, None),
                                  ("tool", "one", None, "c1"), ("tool", "two", None, "c2")]


def test_fields_map_onto_chat() -> None:
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
    chat = _chat(input="Hi", max_output_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=1, stop=["x"],
                 tools=[tool], tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
                 cache_salt="s")
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.top_k, chat.seed, chat.stop) == \
        (7, 0.5, 0.9, 3, 1, ["x"])
    assert chat.tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                            "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.parallel_tool_calls is False and chat.cache_salt == "s" and chat.n == 1
    assert _chat(input="Hi", tool_choice="required").tool_choice == "required"


def test_text_format() -> None:
    assert text_format_spec(None) is None and text_format_spec({"format": {"type": "text"}}) is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = text_format_spec({"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}})
    assert spec.json == schema and spec.origin == "text.format.schema"
    assert text_format_spec({"format": {"type": "json_object"}}).json_object
    for bad, param in [({"type": "json_schema", "name": "x"}, "text.format.schema"),
                       ({"type": "yaml"}, "text.format"),
                       ({"type": "json_schema", "schema": {}, "strict": "yes"}, "text.format.strict"),
                       # OpenAI requires a name ([A-Za-z0-9_-], at most 64)
                       ({"type": "json_schema", "schema": {}}, "text.format.name"),
                       ({"type": "json_schema", "schema": {}, "name": "a b"}, "text.format.name"),
                       ({"type": "json_schema", "schema": {}, "name": "x" * 65}, "text.format.name")]:
        with pytest.raises(APIError) as e:
            text_format_spec({"format": bad})
        assert e.value.param == param


@pytest.mark.parametrize("kw, words", [
    ({"input": []}, "at least one item"),
    ({"input": "x", "metadata": {"a": 1}}, "metadata['a'] must be a string"),
    ({"input": "x", "metadata": {"a": {"b": "c"}}}, "metadata['a'] must be a string"),
    ({"input": "x", "metadata": {"a": "v" * 513}}, "at most 512 characters"),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "at most 64 characters"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "at most 16 key-value pairs"),
    ({"input": ["hi"]}, "input[0] must be an input item object"),
    ({"input": [{"role": "user", "content": "x"}, None]}, "input[1] must be an input item object"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, "'input_text' or 'output_text'"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "'input_audio' is not supported yet"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "must contain a message or function_call item"),
    ({"input": [{"type": "reasoning", "content": "thoughts"}, {"role": "user", "content": "x"}]},
     "input[0].content must be a list of reasoning_text parts"),
    ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text"}]}]}, "input[0].content[0] must be"),
    ({"input": [{"type": "bogus"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    # an output must answer a call made earlier in input (OpenAI: "No tool call found ..."), not reach the model
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "zz", "output": "1"}]},
     "No tool call found for function call output with call_id 'zz'"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, "call_id 'c'"),
    # a bad output names 'output', the field sent (not 'content')
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[1].output must be"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": [{"type": "x"}]}]}, "input[1].output[0]"),
    ({"input": "x", "tools": [{"type": "mcp", "server_label": "s"}]}, "'mcp' is not supported yet"),
    ({"input": "x", "tools": [{"type": "function", "name": ""}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "description": 5}]}, "tools[0].description must be"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict must be"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "'web_search_preview' is not supported yet"),
    ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice must be"),
    ({"input": [{"role": "user", "content": "x"}] * 4097}, "at most 4096 items"),
])
def test_bad_input(kw: dict, words: str) -> None:
    with pytest.raises(APIError) as e:
        _chat(**kw)
    assert words in e.value.message and e.value.status == 400


@pytest.mark.parametrize("value", [0, -1, 2 ** 63])
def test_bad_max_output_tokens_named(value: int) -> None:
    """The error names the Responses field, not chat's max_tokens (which the client never sent)."""
    with pytest.raises(APIError) as e:
        _chat(input="x", max_output_tokens=value)
    assert e.value.param == "max_output_tokens" and "'max_output_tokens'" in e.value.message
    assert "max_tokens" not in e.value.message.replace("max_output_tokens", "")


@pytest.mark.parametrize("kw", [{"store": True}, {"reasoning": {}}, {"reasoning": {"effort": None}},
                                {"include": []}, {"truncation": "disabled"}, {"background": False},
                                {"top_logprobs": 0}])
def test_defaults_not_refused(kw: dict) -> None:
    check_refused(ResponsesRequest(input="x", **kw))


@pytest.mark.parametrize("name, value", [("background", True), ("include", ["reasoning.encrypted_content"]),
                                         ("conversation", "conv_1"), ("prompt", {"id": "p"}),
                                         ("truncation", "auto"), ("max_tool_calls", 2), ("top_logprobs", 2),
                                         ("reasoning", {"summary": "auto"}), ("previous_response_id", "resp_1")])
def test_refused(name: str, value: object) -> None:
    with pytest.raises(APIError) as e:
        check_refused(ResponsesRequest(input="x", **{name: value}))
    assert f"'{name}'" in e.value.message and e.value.param == name


# ---- the stream's events (responses._ResponsesStream), from made-up engine outputs -----------------------------


def _stream_events(plan, steps: list[tuple[str, int, Optional[str]]], error: Optional[Exception] = None) -> list:
    """The events of a stream whose engine steps are (text, number of tokens, finish_reason)."""
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.responses import _ResponsesStream, _ResponseShell

    shell = _ResponseShell(ResponsesRequest(input="x", max_output_tokens=9), "m", "resp_1", 0, 5)
    stream = _ResponsesStream(None, None, None, shell, plan)
    raw = stream.prefix()
    for text, n, finish in steps:
        out = SimpleNamespace(index=0, text=text, token_ids=[0] * n, finish_reason=finish)
        raw += stream.frames([SimpleNamespace(outputs=[out], num_cached_tokens=2)])
    raw += stream.tail(error)
    events = []
    for block in raw.decode().strip().split("\n\n"):
        head, data = block.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert head == "event: " + events[-1]["type"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_stream_text_then_a_call() -> None:
    from pagedllm.entrypoints.openai.tool_calling import plan_tools

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    plan = plan_tools([tool], "auto", None, "hermes", None)
    events = _stream_events(plan, [("Let me look.", 3, None), (' <tool_call>\n{"name": "f", ', 4, None),
                                   ('"arguments": {"a": 1}}\n</tool_call>', 5, "stop")])
    kinds = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == [  # (text deltas: one or more)
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "".join(deltas) and "".join(deltas).strip() == "Let me look."
    call = final["output"][1]
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == ("f", {"a": 1}, "completed")
    assert [e["output_index"] for e in events[-5:-1]] == [1, 1, 1, 1]
    assert final["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 12,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 17}


def test_stream_auto_calls_arrive_in_pieces_one_item_after_another() -> None:
    """tool_choice "auto" calls stream incrementally (chat's tool-call deltas): each call is one function_call item
    whose arguments come in several deltas, the second item opened after the first is done."""
    from pagedllm.entrypoints.openai.tool_calling import extract_tool_calls, plan_tools

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("f", "g")]
    plan = plan_tools(tools, "auto", None, "hermes", None)
    text = ('<tool_call>\n{"name": "f", "arguments": {"a": "xyz", "b": [1, 2]}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {"c": true}}\n</tool_call>')
    events = _stream_events(plan, [(ch, 1, None) for ch in text[:-1]] + [(text[-1], 1, "stop")])
    calls = [(e["output_index"], e["type"]) for e in events if "function_call" in e["type"]
             or e["type"].startswith("response.output_item")]
    assert [k for i, k in enumerate(calls) if i == 0 or k != calls[i - 1]] == [
        (0, "response.output_item.added"), (0, "response.function_call_arguments.delta"),
        (0, "response.function_call_arguments.done"), (0, "response.output_item.done"),
        (1, "response.output_item.added"), (1, "response.function_call_arguments.delta"),
        (1, "response.function_call_arguments.done"), (1, "response.output_item.done")]
    pieces = [e for e in events if e["type"] == "response.function_call_arguments.delta" and e["output_index"] == 0]
    assert len(pieces) > 3
    final = events[-1]["response"]
    assert [(i["name"], i["arguments"]) for i in final["output"]] == [
        (c.name, c.arguments) for c in extract_tool_calls(plan, text, "stop").tool_calls]


def test_stream_length_and_empty_and_error() -> None:
    from pagedllm.entrypoints.openai.tool_calling import ToolPlan

    events = _stream_events(ToolPlan("none"), [("Once", 1, None), (" upon", 1, "length")])
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == "Once upon"
    # nothing generated: an empty message, as the full response has (no empty delta)
    events = _stream_events(ToolPlan("none"), [("", 1, "stop")])
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    # a failure after the headers: an error event, the last
    events = _stream_events(ToolPlan("none"), [("Once", 1, None)], error=APIError("engine gone", status=503))
    assert events[-1]["type"] == "error" and events[-1]["message"] == "engine gone" and events[-1]["code"] == "503"
