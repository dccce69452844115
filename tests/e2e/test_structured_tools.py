"""Structured outputs and tool calling through `pagedllm serve` (SmolLM2) with the real openai SDK and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema", reason="validates the structured outputs")
openai = pytest.importorskip("openai", reason="these tests call the server with the openai SDK")

from e2e_helpers import API_KEY, SERVED_NAME, Server  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 24}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def _chat(client, **kw):
    return client.chat.completions.create(model=SERVED_NAME, temperature=0, **kw)


def test_json_schema_response_format_stream_and_not(client: openai.OpenAI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    r = _chat(client, messages=msgs, response_format=rf, max_tokens=60)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       _chat(client, messages=msgs, response_format=rf, max_tokens=60, stream=True) if c.choices)
    assert streamed == text
    obj = _chat(client, messages=msgs, response_format={"type": "json_object"}, max_tokens=40)
    assert obj.choices[0].message.content.lstrip().startswith("{")
    plain = _chat(client, messages=msgs, response_format={"type": "text"}, max_tokens=5)
    assert plain.choices[0].message.content


def test_regex_choice_grammar_via_vllm_fields(client: openai.OpenAI) -> None:
    r = client.completions.create(model=SERVED_NAME, prompt="My phone number is", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
    r = _chat(client, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=5,
              extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = _chat(client, messages=[{"role": "user", "content": "Add two numbers."}], max_tokens=20,
              extra_body={"guided_grammar": 'root ::= num " + " num\nnum ::= [1-9] [0-9]?'})
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", r.choices[0].message.content)
    r = _chat(client, messages=[{"role": "user", "content": "JSON"}], max_tokens=60,
              extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_constrained_and_free_requests_batched(server: Server) -> None:
    """Concurrent requests share steps; the free ones keep exactly their solo tokens."""
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    free = dict(model=SERVED_NAME, prompt="The capital of France is", max_tokens=12, temperature=0)

    async def run() -> tuple[str, list]:
        solo = (await aclient.completions.create(**free)).choices[0].text
        constrained = [aclient.completions.create(model=SERVED_NAME, prompt=f"Person {i}:", max_tokens=40,
                                                  temperature=0, extra_body={"guided_json": PERSON})
                       for i in range(2)]
        together = await asyncio.gather(aclient.completions.create(**free), *constrained,
                                        aclient.completions.create(**free))
        await aclient.close()
        return solo, together

    solo, results = asyncio.run(run())
    assert results[0].choices[0].text == results[-1].choices[0].text == solo
    for r in results[1:-1]:
        jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def _args(call) -> dict:
    return json.loads(call.function.arguments)


def test_named_tool_choice_gives_a_valid_call_streamed_equal(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = _chat(client, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.content is None  # (a forced named call: OpenAI's, vLLM's)
    (call,) = msg.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(_args(call), WEATHER["function"]["parameters"])
    with client.chat.completions.stream(model=SERVED_NAME, temperature=0, messages=ASK, tools=[WEATHER, TIME],
                                        tool_choice=choice, max_tokens=60) as stream:
        final = stream.get_final_completion()
    (scall,) = final.choices[0].message.tool_calls
    assert (scall.function.name, scall.function.arguments) == (call.function.name, call.function.arguments)
    assert final.choices[0].finish_reason == "stop"



@pytest.mark.parametrize("cut, finish", [({"max_tokens": 4}, "length"), ({"stop": ["city"]}, "stop")])
def test_named_tool_choice_cut_short_is_a_call(client: openai.OpenAI, cut: dict, finish: str) -> None:
    """max_tokens or a stop string ends the arguments early: streamed or not, the answer is the named call with the
    unfinished arguments and that finish_reason (as vLLM and OpenAI), not the arguments as content."""
    kw = dict(messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
              **{"max_tokens": 40, **cut})
    r = _chat(client, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == finish and msg.content is None
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.lstrip().startswith("{")
    with client.chat.completions.stream(model=SERVED_NAME, temperature=0, **kw) as stream:
        for _ in stream:
            pass
        final = stream.current_completion_snapshot  # get_final_completion() parses the unfinished arguments
    (scall,) = final.choices[0].message.tool_calls
    assert (scall.function.name, scall.function.arguments) == (call.function.name, call.function.arguments)
    assert final.choices[0].finish_reason == finish


def test_streamed_tool_calls_carry_every_tokens_logprobs(client: openai.OpenAI) -> None:
    """The text of a "required" call is held back until it parses (here until max_tokens ends it); its tokens'
    logprobs still all go out, in order, as in the full response."""
    kw = dict(messages=ASK, tools=[WEATHER], tool_choice="required", logprobs=True, top_logprobs=1, max_tokens=12)
    full = [t.token for t in _chat(client, **kw).choices[0].logprobs.content]
    streamed = [t.token for chunk in _chat(client, stream=True, **kw) for c in chunk.choices
                if c.logprobs and c.logprobs.content for t in c.logprobs.content]
    assert len(full) > 5 and streamed == full

def test_auto_tool_choice_parallel_tool_calls_false_answers_one_call(client: openai.OpenAI) -> None:
    """"auto" has no grammar, so the model may write two calls (a regex makes it here); parallel_tool_calls false
    answers the first only, as vLLM (streaming reads the same extraction: tests/structured/test_tool_parsers.py)."""
    call = r'<tool_call>\n\{"name": "%s", "arguments": \{\}\}\n</tool_call>'
    kw = dict(messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False, max_tokens=80,
              extra_body={"guided_regex": call % "get_time" + r"\n" + call % "get_weather"})
    r = _chat(client, **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, _args(c)) for c in r.choices[0].message.tool_calls] == [("get_time", {})]



def test_required_tool_choice_with_local_refs(client: openai.OpenAI) -> None:
    """Parameters written with "$ref": "#/$defs/X" (as pydantic writes them): "required" once answered 400 (the
    definitions were not where the refs point in the joined schema)."""
    params = {"type": "object", "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}},
              "properties": {"unit": {"$ref": "#/$defs/unit"}}, "required": ["unit"]}
    tool = {"type": "function", "function": {"name": "set_unit", "parameters": params}}
    r = _chat(client, messages=ASK, tools=[tool], tool_choice="required", parallel_tool_calls=False, max_tokens=40)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "set_unit" and _args(call)["unit"] in ("celsius", "fahrenheit")

def test_round_trip_call_tool_message_answer(client: openai.OpenAI) -> None:
    # (one call, room to finish it: the random model's JSON has no reason to be short)
    first = _chat(client, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=160)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    answer = _chat(client, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=30)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    auto = _chat(client, messages=history, tools=[WEATHER], max_tokens=30)  # "auto" by default with tools
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert auto.choices[0].message.content or auto.choices[0].message.tool_calls


def test_tool_choice_none_still_shows_the_tools(server: Server, client: openai.OpenAI) -> None:
    """vLLM's default (--exclude-tools-when-tool-choice-none off): tool_choice "none" renders the prompt "auto"
    would (the tools in it) and answers content only. The tools were left out of the prompt."""
    body = {"messages": ASK, "tools": [WEATHER]}
    with server.client() as http:
        auto = http.post("/tokenize", json=body).json()["tokens"]
        none = http.post("/tokenize", json=dict(body, tool_choice="none")).json()["tokens"]
        bare = http.post("/tokenize", json={"messages": ASK}).json()["tokens"]
    assert none == auto and len(none) > len(bare)
    r = _chat(client, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert r.usage.prompt_tokens == len(auto) and not r.choices[0].message.tool_calls


def test_exclude_tools_when_tool_choice_none_leaves_them_out() -> None:
    """The flag's plan: no tools in the prompt of a "none" request (its conversation as it came)."""
    from pagedllm.entrypoints.cli.main import build_parser
    from pagedllm.entrypoints.openai.tool_calling import plan_tools, prepare_conversation

    args = build_parser().parse_args(["serve", "m", "--exclude-tools-when-tool-choice-none"])
    assert args.exclude_tools_when_tool_choice_none is True
    for template in (None, "{% for t in tools %}{{ t }}{% endfor %}"):
        plan = plan_tools([WEATHER], "none", None, "auto", template, show_unused=False)
        assert prepare_conversation(list(ASK), plan, template) == (ASK, None)
        shown = plan_tools([WEATHER], "none", None, "auto", template)
        assert prepare_conversation(list(ASK), shown, template) != (ASK, None)


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "nope"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    ({"guided_grammar": "root ::= missing"}, "missing"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "one output constraint"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"jsn": {}}}, "Unknown structured_outputs field"),
    # not a boolean: once a 503 for every request (it stopped the engine process, which could not decode it)
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object must be true or false"),
    ({"structured_outputs": {"json": {}, "disable_any_whitespace": "no"}}, "disable_any_whitespace"),
    ({"guided_json": {"type": "integer", "maximum": 10 ** 30}}, "beyond 64 bits"),  # once a 500 (msgpack)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"enum": [10 ** 30]}}}}}],
      "tool_choice": "required"}, "beyond 64 bits"),
    ({"tool_choice": "required"}, "`tools` must be set"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "launch"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "bogus"),
    # once a 200 with any JSON value (xgrammar does not fetch it and allows anything there)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}}}}, "points outside the schema"),
    # once a 200 whose call's arguments were a JSON string
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters must describe an object"),
    ({"tools": [WEATHER, TIME, WEATHER]}, "tools[2].function.name 'get_weather' duplicates tools[0]'s"),
    # once accepted and ignored, where response_format's strict must be a boolean
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "tools[0].function.strict must be true or false, got 'yes'."),
    # once a 200 whose items repeated (xgrammar compiled uniqueItems without enforcing it)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "'uniqueItems' cannot be honoured"),
    # once a 200 (tool_choice "auto" / "none" compile no grammar, so the schema only went into the prompt)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}]}, "Invalid tools[0].function.parameters: properties.a.type must be one of"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}],
      "tool_choice": "none", "stream": True}, "Invalid tools[0].function.parameters: required must be a list"),
])
def test_bad_inputs_are_400(server: Server, body: dict, needle: str) -> None:
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": ASK, "max_tokens": 5, **body})
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "x", "max_tokens": 3,
                                              "guided_json": {"type": "object", "properties": {"a": {"type": 5}}}})
        assert r.status_code == 400, r.text


@pytest.mark.parametrize("body, where, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "response_format"),
    ({"guided_json": {"type": "nope"}}, "guided_json", "guided_json"),
    ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex", "guided_regex"),  # refused after add_request
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "guided_grammar"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters", "tools"),
])
def test_spec_errors_name_the_field_sent(server: Server, body: dict, where: str, param: str) -> None:
    """Once every engine-side spec error said "structured_outputs.json" (param null), whatever field was sent."""
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": ASK, "max_tokens": 5, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"].startswith(f"Invalid {where}: ") and error["param"] == param, error


def _literal_regex(text: str) -> str:
    return "".join("\\" + ch if ch in "\\^$.|?*+()[]{}" else "\\n" if ch == "\n" else ch for ch in text)


_WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.mark.parametrize("text", [
    _WEATHER_CALL,
    "\n" + _WEATHER_CALL,
    "Sure!\n" + _WEATHER_CALL,
    "  Let me look.\n\n" + _WEATHER_CALL + "\nDone.",
    "No call here <tool but prose.",
    "Bad <tool_call>{not json}</tool_call>",
])
def test_auto_tool_choice_stream_equals_full(client: openai.OpenAI, text: str) -> None:
    """tool_choice "auto" (a regex forces what the model writes): the streamed content deltas add up to the full
    response's message.content and the calls are the same (once, text around a call was stripped in one only)."""
    kw = dict(messages=ASK, tools=[WEATHER, TIME], max_tokens=80, extra_body={"guided_regex": _literal_regex(text)})
    full = _chat(client, **kw).choices[0]
    content, calls, finish = "", {}, None
    for chunk in _chat(client, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, ["", ""])
                slot[0] += tc.function.name or ""
                slot[1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert content == (full.message.content or "")
    assert [tuple(calls[i]) for i in sorted(calls)] == [(c.function.name, c.function.arguments)
                                                       for c in full.message.tool_calls or []]
    assert finish == full.finish_reason
    if "get_weather" in text:
        assert full.finish_reason == "tool_calls" and full.message.tool_calls[0].function.name == "get_weather"
        assert full.message.content == (text[:text.index("<tool_call>")] if text.strip()[0] != "<" else None)
    else:
        assert full.message.content == text and full.finish_reason == "stop"


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                "schema": {"allOf": [{"type": "string"},
                                                                                     {"type": "integer"}]}}}},
    {"structured_outputs": {"json": {"anyOf": []}}},
    {"guided_json": {"type": "object", "required": ["a"], "additionalProperties": False}},
    {"guided_json": {"not": {}}},
    # once a 200 with empty content ("auto" took llguidance for what xgrammar refused, which matched nothing)
    {"guided_json": {"$ref": "#"}},
    {"structured_outputs": {"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                     "$ref": "#/$defs/a"}}},
    # once a 200 that nested {"a": {"a": ... until max_tokens
    {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}},
])
def test_unsatisfiable_json_schema_is_400(server: Server, body: dict) -> None:
    """A schema no JSON value satisfies: once a 200 with any JSON value (allOf, not: xgrammar drops them) or an
    empty / schema-breaking answer ("{}" for a required property); now a 400 with the reason."""
    with server.client() as http:
        for path, extra in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "x"})):
            r = http.post(path, json={"model": SERVED_NAME, "max_tokens": 5, **extra, **body})
            assert r.status_code == 400, r.text
            assert "no JSON value satisfies the schema" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("params, reason", [
    ({"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}, "required property 'a'"),
    ({"type": "object", "properties": {"kids": {"type": "array", "minItems": 1, "items": {"$ref": "#"}}},
      "required": ["kids"]}, "recurse without end"),
])
def test_tool_whose_parameters_admit_nothing_is_400(server: Server, params: dict, reason: str) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    with server.client() as http:
        for choice in ("required", {"type": "function", "function": {"name": "f"}}):
            r = http.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": ASK, "max_tokens": 5,
                                                        "tools": [tool], "tool_choice": choice})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "tools" and error["message"].startswith(
                "tools[0].function.parameters admit no arguments at all (") and reason in error["message"], error


def test_grammar_without_a_complete_derivation_ends_cleanly(client: openai.OpenAI) -> None:
    """A grammar that never completes cannot be told up front (vLLM neither): the request runs to max_tokens and
    ends with finish_reason "length", streamed or not, and the server goes on serving."""
    kw = dict(messages=ASK, max_tokens=6, extra_body={"guided_grammar": 'root ::= "a" root'})
    r = _chat(client, **kw)
    assert r.choices[0].finish_reason == "length" and set(r.choices[0].message.content) == {"a"}
    finish = [c.finish_reason for chunk in _chat(client, stream=True, **kw) for c in chunk.choices if c.finish_reason]
    assert finish == ["length"]
    assert _chat(client, messages=ASK, max_tokens=3).choices[0].message.content


def test_all_of_several_schemas_is_enforced(client: openai.OpenAI) -> None:
    """allOf of several schemas: xgrammar compiles it into any JSON value; "auto" hands it to llguidance, which
    keeps to it."""
    schema = {"allOf": [{"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"]},
                        {"type": "object", "properties": {"n": {"type": "integer", "maximum": 7}}}]}
    r = _chat(client, messages=[{"role": "user", "content": "A number as JSON."}], max_tokens=30,
              response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.parametrize("body", [{"guided_regex": "[^\\x00-\\U0010FFFF]"},
                                  {"structured_outputs": {"grammar": "root ::= [^\\x00-\\U0010FFFF]"}}])
def test_spec_with_no_first_token_is_400(server: Server, body: dict) -> None:
    """A regex / grammar that compiles but allows no first token: once a 200 with "" and finish_reason "abort"."""
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": ASK, "max_tokens": 5, **body})
        assert r.status_code == 400, r.text
        assert "matches no text at all" in r.json()["error"]["message"]


def test_required_tool_choice_with_recursive_parameters(client: openai.OpenAI) -> None:
    """Parameters that refer to their own root ("$ref": "#", a tree): "required" joins the functions in one
    schema, where "#" once meant the whole list of calls (the kids came out as lists of calls)."""
    params = {"type": "object", "properties": {"label": {"enum": ["x", "y"]},
                                               "kids": {"type": "array", "maxItems": 1, "items": {"$ref": "#"}},
                                               "same": {"$ref": "#/properties/label"}},
              "required": ["label", "kids"]}
    tool = {"type": "function", "function": {"name": "tree", "parameters": params}}
    r = _chat(client, messages=ASK, tools=[tool], tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    if r.choices[0].finish_reason == "tool_calls":
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(_args(call), params)
        return
    # The tiny model may nest deeper than max_tokens: the kid written so far is a tree node, not a list of calls.
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and text.count('"name"') == 1, text
    assert re.search(r'"kids"\s*:\s*\[\s*(\]|\{\s*"(label|kids|same)")', text), text


NULLABLE_ROOTS = [{"type": ["object", "null"], "properties": {"city": {"type": "string", "maxLength": 12}}},
                  {"anyOf": [{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}},
                             {"type": "null"}]}]


@pytest.mark.parametrize("params", NULLABLE_ROOTS)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "maybe"}}])
def test_forced_call_with_nullable_parameters_writes_an_object(client: openai.OpenAI, params: dict, choice) -> None:
    """Parameters whose root also admits null: a forced call's arguments are still a JSON object (the grammar once
    let the model write `null`, which clients parse as the arguments)."""
    tool = {"type": "function", "function": {"name": "maybe", "parameters": params}}
    r = _chat(client, messages=ASK, tools=[tool], tool_choice=choice, parallel_tool_calls=False, max_tokens=80)
    assert r.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop"), r.choices[0]
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "maybe" and isinstance(_args(call), dict), call.function.arguments


def test_disable_fallback_is_honoured(server: Server) -> None:
    """vLLM's structured_outputs.disable_fallback: once an "unknown field" 400; now a Lark grammar (llguidance
    only) is refused instead of handed to llguidance, and a spec xgrammar takes is served as without it."""
    lark = 'start: "yes" | "no"'
    with server.client() as http:
        def ask(spec: dict):
            return http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "Is it?", "max_tokens": 3,
                                                      "temperature": 0, "structured_outputs": spec})
        r = ask({"grammar": lark, "disable_fallback": True})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            "Invalid structured_outputs.grammar: "), r.text
        r = ask({"grammar": lark})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
        r = ask({"choice": ["yes", "no"], "disable_fallback": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
