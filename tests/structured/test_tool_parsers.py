"""Each tool-call parser on hand-written outputs of its format, malformed ones included (returned as content),
tool_choice planning errors, and the streaming helper: its deltas, accumulated the way the OpenAI SDK does,
equal the non-streamed extraction."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_calling import (
    ToolRequestError,
    extract_tool_calls,
    finish_reason_with_tools,
    plan_tools,
    prepare_conversation,
    tool_structured_outputs,
)
from pagedllm.entrypoints.openai.tool_parsers import detect_tool_parser, get_tool_parser
from pagedllm.entrypoints.openai.tool_streaming import ToolCallStreamer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def calls(result) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


@pytest.mark.parametrize("parser, text, content, expected", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "Sure.\n",
     [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n<tool_call>'
               '{"name": "get_time", "arguments": {}}</tool_call>', None,
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": "{}"}', None, [("get_time", {})]),  # unclosed at EOS
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "X"}}',
     None, [("get_time", {}), ("get_weather", {"city": "X"})]),
    ("mistral", 'ok [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}]', "ok ",
     [("get_weather", {"city": "Lyon"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_time[ARGS]{}', None,
     [("get_weather", {"city": "Nice"}), ("get_time", {})]),
    ("pythonic", '[get_weather(city="Bern"), get_time()]', None, [("get_weather", {"city": "Bern"}), ("get_time", {})]),
    ("pythonic", '<|python_start|>[get_weather(city=null)]<|python_end|>', None, [("get_weather", {"city": None})]),
])
def test_parsers_read_their_format(parser: str, text: str, content, expected) -> None:
    result = get_tool_parser(parser, TOOLS).extract(text)
    assert calls(result) == expected
    assert result.content == content
    assert all(c.id.startswith("call_") for c in result.tool_calls)


@pytest.mark.parametrize("parser, text", [
    ("hermes", "<tool_call>{not json}</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'),  # not an offered tool
    ("hermes", "just words"),
    ("llama3_json", '{"name": "get_time", "parameters": {}} and then prose'),
    ("llama3_json", '{"name": "get_time", "parameters": [1, 2]}'),
    ("mistral", "[TOOL_CALLS][{broken"),
    ("mistral", "[TOOL_CALLS]get_time[ARGS]not json"),
    ("pythonic", "[get_weather(city=undefined_name)]"),
    ("pythonic", "[get_weather('positional')]"),
    # a ** unpacking: its arguments were once dropped silently (a call with {})
    ("pythonic", "[get_weather(**{'city': 'Paris'})]"),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[get_weather(city='x'"),
])
def test_malformed_output_is_plain_content(parser: str, text: str) -> None:
    result = get_tool_parser(parser, TOOLS).extract(text)
    assert result.tool_calls == [] and result.content == text


def test_auto_detection_from_templates() -> None:
    assert detect_tool_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_parser("<|python_tag|>") == "llama3_json"
    assert detect_tool_parser(None) == "hermes"
    with pytest.raises(ValueError, match="Unknown tool call parser"):
        get_tool_parser("nope")


@pytest.mark.parametrize("tools, choice, match", [
    (None, "required", "`tools` must be set"),
    (None, {"type": "function", "function": {"name": "get_time"}}, "`tools` must be set"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not in tools"),
    (TOOLS, "sometimes", "tool_choice must be"),
    ([{"type": "function", "function": {"description": "x"}}], "auto", "name must be"),
    ([{"type": "retrieval"}], "auto", "tools\\[0\\]"),
    # once passed silently (a call to "get_time" could mean either); every tool_choice refuses them
    (TOOLS + [TOOLS[1]], "auto", "tools\\[2\\].function.name 'get_time' duplicates tools\\[1\\]'s"),
    (TOOLS + [TOOLS[0]], "required", "duplicates tools\\[0\\]'s"),
    (TOOLS + [TOOLS[1]], "none", "must be unique"),
    # once a 200 under "auto" / "none" (no grammar is compiled there that would refuse them); OpenAI refuses them
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}], "auto", "Invalid tools\\[0\\].function.parameters: properties.a.type must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}], "none",
     "required must be a list"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "array", "items": [{"anyOf": []}]}}}}}], "auto", "properties.a.items\\[0\\].anyOf must be"),
])
def test_bad_tool_requests(tools, choice, match: str) -> None:
    with pytest.raises(ToolRequestError, match=match) as e:
        plan_tools(tools, choice, None, "auto", None)
    assert e.value.param in ("tools", "tool_choice")


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
    {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True, "items": [{"type": "integer"}]}}},
    {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    {"type": "object", "properties": {"a": {"type": ["string", "null"], "pattern": "(?<=x)y"}, "b": True}},
    {"type": "object", "properties": {"a": {"type": "number", "minimum": 0, "exclusiveMinimum": True}}},  # draft 4
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5.0}}},  # (an integer to JSON Schema)
])
def test_valid_schemas_no_grammar_enforces_pass_under_auto(parameters: dict) -> None:
    """The schema check is the meta-schema's, not a grammar backend's: valid keywords neither backend enforces
    (not, uniqueItems, if / then, lookbehind) are fine where the schema only goes into the prompt."""
    plan = plan_tools([{"type": "function", "function": {"name": "f", "parameters": parameters}}], "auto", None,
                      "hermes", None)
    assert plan.mode == "auto"


def test_tool_choice_grammars() -> None:
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, "auto", None)
    assert tool_structured_outputs(named).json == TOOLS[0]["function"]["parameters"]
    required = tool_structured_outputs(plan_tools(TOOLS, "required", False, "auto", None)).json
    assert required["minItems"] == 1 and required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    assert tool_structured_outputs(plan_tools(TOOLS, "auto", None, "auto", None)) is None
    assert plan_tools(None, None, None, "auto", None).mode == "none"



def test_required_grammar_lifts_local_definitions_to_its_root() -> None:
    """Parameters with "$ref": "#/$defs/X" (pydantic's way) sit inside the "required" schema, so their definitions
    move to its root, where the refs point (as vLLM); the request's tools stay as they were."""
    unit = {"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "$defs": {"u": {"enum": ["c", "f"]}}, "properties": {"unit": {"$ref": "#/$defs/u"}}}}}
    legacy = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "definitions": {"z": {"type": "string"}}, "properties": {"tz": {"$ref": "#/definitions/z"}}}}}
    schema = tool_structured_outputs(plan_tools([unit, legacy], "required", None, "auto", None)).json
    assert schema["$defs"] == {"u": {"enum": ["c", "f"]}} and schema["definitions"] == {"z": {"type": "string"}}
    assert all("$defs" not in v["properties"]["arguments"] and "definitions" not in v["properties"]["arguments"]
               for v in schema["items"]["anyOf"])
    assert "$defs" in unit["function"]["parameters"]
    clash = json.loads(json.dumps(unit).replace("set_unit", "other").replace('"f"', '"k"'))
    with pytest.raises(ValueError, match=r"define \$defs/u differently"):
        tool_structured_outputs(plan_tools([unit, clash], "required", None, "auto", None))

def test_prompt_for_templates_without_tools() -> None:
    plan = plan_tools(TOOLS, "auto", None, "auto", None)
    conv = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out, template_tools = prepare_conversation(conv, plan, "{{ messages }}")
    assert template_tools is None and out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    native, template_tools = prepare_conversation(conv, plan, "{% for t in tools %}{% endfor %}")
    assert template_tools == TOOLS and native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_prompt_without_tool_support_says_what_the_grammar_enforces() -> None:
    """A template without tool support is told the form the request's grammar forces: "required" a JSON list of
    calls (not <tool_call> blocks), a named choice that function (it was not described at all) and its arguments."""
    ask = [{"role": "user", "content": "weather?"}]
    system = {}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        plan = plan_tools(TOOLS, choice, False if choice == "required" else None, "auto", None)
        out, template_tools = prepare_conversation(list(ask), plan, "{{ messages }}")
        assert template_tools is None and out[0]["role"] == "system" and out[1:] == ask
        system[plan.mode] = out[0]["content"]
    assert "<tool_call>" in system["auto"] and "get_time" in system["auto"]
    assert "JSON list (one call)" in system["required"] and "<tool_call>" not in system["required"]
    assert all(name in system["required"] for name in ("get_weather", "get_time"))
    named = system["named"]
    assert "get_weather" in named and "get_time" not in named and "arguments only" in named


def _accumulate(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What the OpenAI SDK's stream accumulation does with chat-chunk deltas."""
    content, tool_calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            slot = tool_calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.get("id") or slot["id"]
            fn = tc.get("function") or {}
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
    return content, [tool_calls[i] for i in sorted(tool_calls)]


def _stream(plan, text: str, finish: str, step: int = 3):
    s = ToolCallStreamer(plan)
    deltas = []
    for i in range(0, len(text), step):
        deltas += s.feed(text[i:i + step])
    last, reason = s.finish(finish)
    return _accumulate(deltas + last), reason, deltas


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("hermes", "No tools needed <tool but a lone bracket"),
    ("llama3_json", '{"name": "get_time", "parameters": {}}'),
    ("pythonic", 'plain words [not a call'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
])
def test_streamed_deltas_equal_the_full_extraction(parser: str, text: str) -> None:
    plan = plan_tools(TOOLS, "auto", None, parser, None)
    (content, streamed), reason, deltas = _stream(plan, text, "stop")
    full = extract_tool_calls(plan, text, "stop")
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in full.tool_calls]
    assert reason == ("tool_calls" if full.called else "stop")
    if full.called:
        assert content == (full.content or "")
        assert not any("<tool_call>" in (d.get("content") or "") for d in deltas)
    else:
        assert content == text


def test_named_choice_streams_argument_deltas() -> None:
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, "auto", None)
    text = '{"city": "Paris"}'
    (content, streamed), reason, deltas = _stream(plan, text, "stop", step=2)
    # a forced named call finishes "stop", as OpenAI and vLLM answer (streamed and not)
    assert content == "" and reason == "stop" == finish_reason_with_tools(extract_tool_calls(plan, text, "stop"),
                                                                          "stop") and len(deltas) > 3
    full = extract_tool_calls(plan, text, "stop")
    assert streamed[0]["name"] == "get_weather" == full.tool_calls[0].name
    assert streamed[0]["arguments"] == full.tool_calls[0].arguments == text


@pytest.mark.parametrize("finish", ["length", "stop"])  # max_tokens, a stop string
def test_named_choice_cut_short_is_still_the_call(finish: str) -> None:
    """max_tokens or a stop string ends a named call's arguments early: the full response holds the call (its
    arguments unfinished, as the stream sent them), never the arguments as content; finish_reason is not
    "tool_calls"."""
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, "auto", None)
    text = '{"city": "Pa'
    (content, streamed), reason, _ = _stream(plan, text, finish, step=2)
    full = extract_tool_calls(plan, text, finish)
    assert full.content is None and [(c.name, c.arguments) for c in full.tool_calls] == [("get_weather", text)]
    assert [(c["name"], c["arguments"]) for c in streamed] == [("get_weather", text)] and content == ""
    assert reason == finish_reason_with_tools(full, finish) == finish


def test_auto_with_parallel_tool_calls_false_keeps_the_first_call() -> None:
    """"auto" has no grammar: a model may still write two calls; parallel_tool_calls false answers the first only
    (as vLLM), streamed or not."""
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    single = plan_tools(TOOLS, "auto", False, "hermes", None)
    assert calls(extract_tool_calls(single, text, "stop")) == [("get_weather", {"city": "Rome"})]
    (_, streamed), reason, _ = _stream(single, text, "stop")
    assert [c["name"] for c in streamed] == ["get_weather"] and reason == "tool_calls"
    assert len(extract_tool_calls(plan_tools(TOOLS, "auto", None, "hermes", None), text, "stop").tool_calls) == 2


_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
_LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
_AUTO_TEXTS = [
    ("hermes", f"<tool_call>\n{_CALL}\n</tool_call>"),
    ("hermes", f"\n\n<tool_call>\n{_CALL}\n</tool_call>"),  # whitespace alone before the call
    ("hermes", f"Sure!\n<tool_call>\n{_CALL}\n</tool_call>"),
    ("hermes", f"  Let me check.\n\n<tool_call>{_CALL}</tool_call>\nDone."),  # text after the call is dropped
    ("hermes", f"A <tool_call>{_CALL}</tool_call> B <tool_call>{_CALL}</tool_call>"),
    ("hermes", f"<tool_call>\n{_CALL}"),  # unclosed at EOS
    ("hermes", "Hi <tool_call>{broken</tool_call>"),  # not a call: all of it is content
    ("hermes", 'x <tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'),  # not an offered tool
    ("hermes", "   "),
    ("hermes", "\n  plain answer <tool and <tool_cal but no call\n"),
    ("hermes", "ends on a partial marker <tool_c"),
    ("llama3_json", _LLAMA),
    ("llama3_json", f"\n  <|python_tag|>{_LLAMA}"),
    ("llama3_json", f"{_LLAMA}; {_LLAMA}"),
    ("llama3_json", f"Text first {_LLAMA}"),  # not at the start: content
    ("llama3_json", "  {not json at all"),
    ("llama3_json", "<|py but not the tag"),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
    ("mistral", ' \n[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
    ("mistral", 'Checking:\n [TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}'),
    ("mistral", "words [TOOL_CALL but no call"),
    ("pythonic", '[get_weather(city="Bern"), get_time()]'),
    ("pythonic", ' \n[get_time()]'),
    ("pythonic", "plain words [not a call"),
    ("pythonic", "[1, 2, 3]"),
    ("qwen3_coder", "Let me see <tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>"),
    ("qwen3_coder", "<function=get_time>\n</function>\n</tool_call>"),  # no opening <tool_call>
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOs"),  # cut short
    ("qwen3_coder", "a <tool_call> b, no function"),
]


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("parser, text", _AUTO_TEXTS)
def test_auto_stream_content_and_calls_equal_the_full_response(parser: str, text: str, step: int) -> None:
    """tool_choice "auto": whatever the model writes and however it is split into deltas, the streamed content
    deltas add up to the full response's message.content ("" for None) and the calls are the same. Cut short
    ("length"), the full response is all content; calls that streamed already cannot be taken back (as vLLM):
    then the content is the text before them and the finish reason stays "length"."""
    for finish in ("stop", "length"):
        plan = plan_tools(TOOLS, "auto", None, parser, None)
        (content, streamed), reason, deltas = _stream(plan, text, finish, step=step)
        full = extract_tool_calls(plan, text, finish)
        if finish == "length" and streamed:
            assert content == (extract_tool_calls(plan, text, "stop").content or "") and reason == "length"
            assert all(c["name"] in plan.parser.tool_names for c in streamed)
            continue
        assert content == (full.content or ""), (finish, deltas)
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in full.tool_calls]
        assert reason == finish_reason_with_tools(full, finish)
        if full.called:
            assert all(d.get("content") for d in deltas if "content" in d)  # no empty content deltas


def test_auto_content_keeps_the_text_before_the_call_as_written() -> None:
    """As vLLM's hermes / mistral parsers: the text before the first call, whitespace and all (what streaming has
    already sent), is the content; whitespace alone is none."""
    hermes = get_tool_parser("hermes", TOOLS)
    assert hermes.extract(f"Sure!\n<tool_call>{_CALL}</tool_call>").content == "Sure!\n"
    assert hermes.extract(f"\n \n<tool_call>{_CALL}</tool_call>").content is None
    mistral = get_tool_parser("mistral", TOOLS)
    assert mistral.extract('ok: [TOOL_CALLS]get_time[ARGS]{}').content == "ok: "


@pytest.mark.parametrize("params", [{"type": "string"}, {"type": ["array", "null"]}])
def test_tool_parameters_must_describe_an_object(params: dict) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    with pytest.raises(ToolRequestError, match=r"tools\[0\].function.parameters must describe an object"):
        plan_tools(tools, "required", None, "hermes", None)
    for ok in ({"type": ["object", "null"]}, {"properties": {}}, {}):
        plan_tools([{"type": "function", "function": {"name": "f", "parameters": ok}}], "required", None, "hermes",
                   None)


def test_required_schema_redirects_references_to_the_parameters_root() -> None:
    """"$ref": "#" in a function's parameters means those parameters; in the joined "required" schema they become
    a definition of their own and the reference points there ("#/$defs/..." references stay at the root)."""
    params = {"type": "object", "$defs": {"u": {"enum": ["c", "f"]}},
              "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}, "unit": {"$ref": "#/$defs/u"},
                             "same": {"$ref": "#/properties/unit"}, "tag": {"const": {"$ref": "#"}}}}
    tools = [{"type": "function", "function": {"name": "tree", "parameters": params}}, TOOLS[1]]
    schema = tool_structured_outputs(plan_tools(tools, "required", None, "hermes", None)).json
    tree, time_ = schema["items"]["anyOf"]
    assert tree["properties"]["arguments"] == {"$ref": "#/$defs/tools_0_parameters"}
    own = schema["$defs"]["tools_0_parameters"]["properties"]
    assert own["kids"]["items"] == {"$ref": "#/$defs/tools_0_parameters"}
    assert own["same"] == {"$ref": "#/$defs/tools_0_parameters/properties/unit"}
    assert own["unit"] == {"$ref": "#/$defs/u"} and schema["$defs"]["u"] == {"enum": ["c", "f"]}
    assert own["tag"] == {"const": {"$ref": "#"}}  # a value, left as written
    assert time_["properties"]["arguments"] == TOOLS[1]["function"]["parameters"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_tool_whose_parameters_admit_nothing_is_named(choice) -> None:
    tools = [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}}}]
    with pytest.raises(ValueError, match=r"tools\[1\].function.parameters admit no arguments at all \(.*\), so "
                                         r"'f' cannot be called"):
        tool_structured_outputs(plan_tools(tools, choice, None, "hermes", None))
    # "auto" has no grammar; a named choice of another function does not use f's parameters.
    assert tool_structured_outputs(plan_tools(tools, "auto", None, "hermes", None)) is None
    tool_structured_outputs(plan_tools(tools, {"type": "function", "function": {"name": "get_time"}}, None, "hermes",
                                       None))


@pytest.mark.parametrize("parser", ["llama3_json", "pythonic"])
def test_start_only_parsers_release_content_that_only_began_like_a_marker(parser: str) -> None:
    """An answer that starts like a marker ("<" of "<|python_tag|>") but turns out to be text streams as it comes:
    the streamer held all of it to the end once the first delta was "<"."""
    s = ToolCallStreamer(plan_tools(TOOLS, "auto", None, parser, None))
    assert s.feed("<") == []
    assert s.feed("b>Bold") == [{"content": "<b>Bold"}]
    assert s.feed("</b> more") == [{"content": "</b> more"}]
    assert s.finish("stop") == ([], "stop")


def test_auto_keeps_a_parsers_special_token_marker_in_the_text() -> None:
    """Mistral's [TOOL_CALLS] is a special token: with skip_special_tokens (the default) the detokenized text lost it
    and the calls came back as content. tool_choice "auto" with such a marker keeps special tokens (as vLLM does);
    a marker that is plain text, or no parser in play, leaves the request as it is."""
    from pagedllm.entrypoints.openai.chat_tools import apply_tool_grammar
    from pagedllm.sampling_params import SamplingParams
    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    plan = plan_tools(TOOLS, "auto", None, "mistral", None)
    params = SamplingParams()
    apply_tool_grammar(params, plan, tok)
    assert params.skip_special_tokens is False
    ids = tok.encode('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', add_special_tokens=False)
    text = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
    assert calls(extract_tool_calls(plan, text, "stop")) == [("get_time", {})]
    for plan in (plan_tools(TOOLS, "auto", None, "hermes", None), plan_tools(TOOLS, "none", None, "mistral", None)):
        params = SamplingParams()
        apply_tool_grammar(params, plan, tok)
        assert params.skip_special_tokens is True


def test_vllm_llama4_parser_names_are_accepted() -> None:
    """vLLM's docs serve Llama 4 with --tool-call-parser llama4_pythonic (or llama4_json): both names were refused."""
    import argparse

    from pagedllm.entrypoints.openai.cli_args import add_structured_output_args

    text = '<|python_start|>[get_weather(city="Oslo")]<|python_end|>'
    assert calls(get_tool_parser("llama4_pythonic", TOOLS).extract(text)) == [("get_weather", {"city": "Oslo"})]
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert calls(get_tool_parser("llama4_json", TOOLS).extract(text)) == [("get_weather", {"city": "Oslo"})]
    for name in ("llama4_pythonic", "llama4_json"):
        p = argparse.ArgumentParser()
        add_structured_output_args(p)
        assert p.parse_args(["--tool-call-parser", name]).tool_call_parser == name


def test_auto_detects_pythonic_templates_that_also_mention_ipython_parameters() -> None:
    """vLLM's Llama 3.2 / 4 pythonic templates render tool results as the ipython role, say "parameters" in their
    instructions and ask for "[func_name1(...)]": auto picked llama3_json (or hermes), which read their calls as
    content."""
    llama4_like = ("{% if message.role == 'tool' or message.role == 'ipython' %}ipython{% endif %}"
                   "If ALL required parameters are present, use the format [func_name1(param1=value1), func_name2()]")
    llama32_like = "Environment: ipython\nRespond in the format [func_name1(params_name1=params_value1)]"
    for template in (llama4_like, llama32_like):
        assert detect_tool_parser(template) == "pythonic"
    assert detect_tool_parser("Environment: ipython\n{\"name\": function name, \"parameters\": ...}") == "llama3_json"


@pytest.mark.parametrize("parser, template", [("mistral", None), ("auto", "{{ '[TOOL_CALLS]' }}")])
def test_mistral_format_calls_get_nine_character_ids(parser: str, template) -> None:
    """Mistral's chat templates raise on a tool call id that is not 9 alphanumeric characters when the client sends
    the call back: its calls (auto, required, named; streamed or not) get such ids, as vLLM's mistral parser gives;
    other formats keep OpenAI's call_ ids."""
    import re

    nine = re.compile(r"[A-Za-z0-9]{9}")
    auto = plan_tools(TOOLS, "auto", None, parser, template)
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "X"}}]'
    assert all(nine.fullmatch(c.id) for c in extract_tool_calls(auto, text, "stop").tool_calls)
    required = plan_tools(TOOLS, "required", None, parser, template)
    result = extract_tool_calls(required, '[{"name": "get_time", "arguments": {}}]', "stop")
    assert result.called and all(nine.fullmatch(c.id) for c in result.tool_calls)
    (_, streamed), _, _ = _stream(auto, text, "stop")
    assert len(streamed) == 2 and all(nine.fullmatch(c["id"]) for c in streamed)
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, parser, template)
    (_, streamed), _, _ = _stream(named, "{}", "stop")
    assert nine.fullmatch(streamed[0]["id"])
    assert nine.fullmatch(extract_tool_calls(named, "{}", "stop").tool_calls[0].id)
    hermes = plan_tools(TOOLS, "required", None, "hermes", None)
    assert extract_tool_calls(hermes, '[{"name": "get_time", "arguments": {}}]', "stop").tool_calls[0].id.startswith(
        "call_")


_QWEN3_CODER = ("I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\nnorth\n</parameter>\n"
                "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\", \"hours\": [1, 2]}\n</parameter>\n"
                "<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>\n"
                "<tool_call>\n<function=get_time>\n</function>\n</tool_call>")


def test_qwen3_coder_xml_calls_are_read_and_detected() -> None:
    """Qwen3-Coder writes <tool_call><function=NAME><parameter=K>value</parameter>...: auto picked hermes for its
    template (it has <tool_call>), which reads JSON, so every call came back as content. Values follow the schema's
    types (strings as written, multi-line kept); a parameter the schema does not name stays a string."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}}}}}, TOOLS[1]]
    template = "{{ '<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>' }}"
    assert detect_tool_parser(template) == "qwen3_coder"
    plan = plan_tools(tools, "auto", None, "auto", template)
    full = extract_tool_calls(plan, _QWEN3_CODER, "stop")
    assert full.content == "I'll check both.\n"
    assert calls(full) == [("get_weather", {"city": "São Paulo\nnorth", "days": 3, "opts": {"unit": "C", "hours": [1, 2]},
                                            "extra": "42"}), ("get_time", {})]
    assert finish_reason_with_tools(full, "stop") == "tool_calls"
    for step in (1, 2, 7):
        (content, streamed), reason, _ = _stream(plan, _QWEN3_CODER, "stop", step=step)
        assert content == full.content and reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in full.tool_calls]
    assert extract_tool_calls(plan, "No call: <tool_call> without a function", "stop").tool_calls == []
