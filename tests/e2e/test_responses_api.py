"""POST /v1/responses (OpenAI's Responses API) against `pagedllm serve`, with the real openai SDK and raw HTTP.

The anchor: a response's greedy text is the chat completion's greedy text for the same conversation (the request
runs the chat path), and its prompt is the chat prompt (the usage's input_tokens equal chat's prompt_tokens)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai", reason="these tests are of the openai SDK against the server")
jsonschema = pytest.importorskip("jsonschema")

from e2e_helpers import API_KEY, SERVED_NAME, Server, metric  # noqa: E402

ASK = "What is the capital of France? Answer in one word."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def _chat(http: httpx.Client, messages: list, **kw) -> dict:
    r = http.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": messages, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _text(resp) -> str:
    return "".join(p.text for item in resp.output if item.type == "message" for p in item.content)


def test_greedy_text_equals_chat(client: openai.OpenAI, http: httpx.Client) -> None:
    r = client.responses.create(model=SERVED_NAME, input=ASK, temperature=0, max_output_tokens=12)
    chat = _chat(http, [{"role": "user", "content": ASK}], max_tokens=12)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == SERVED_NAME
    assert [item.type for item in r.output] == ["message"]
    msg = r.output[0]
    assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert _text(r) == r.output_text == chat["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.status == ("incomplete" if chat["choices"][0]["finish_reason"] == "length" else "completed")
    assert r.max_output_tokens == 12 and r.temperature == 0


def test_instructions_and_items_are_the_chat_conversation(client: openai.OpenAI, http: httpx.Client) -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "developer", "content": "Be brief."},
             {"role": "user", "content": ASK}]
    r = client.responses.create(model=SERVED_NAME, instructions="You are a geography teacher.", input=items,
                                temperature=0, max_output_tokens=10, metadata={"k": "v"})
    chat = _chat(http, [{"role": "system", "content": "You are a geography teacher."},
                        {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}], max_tokens=10)
    assert _text(r) == chat["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.instructions == "You are a geography teacher." and r.metadata == {"k": "v"}


def test_cached_tokens(http: httpx.Client) -> None:
    """A repeated prompt finds its full blocks in the prefix cache: usage.input_tokens_details.cached_tokens."""
    req = {"model": SERVED_NAME, "input": "A prompt long enough to fill one or two cache blocks, said twice. " * 3,
           "max_output_tokens": 2, "temperature": 0}
    http.post("/v1/responses", json=req)
    usage = http.post("/v1/responses", json=req).json()["usage"]
    assert 0 < usage["input_tokens_details"]["cached_tokens"] < usage["input_tokens"]


def test_max_output_tokens_incomplete(http: httpx.Client) -> None:
    r = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "Tell me a long story.",
                                         "max_output_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and body["usage"]["output_tokens"] == 3


def _events(r: httpx.Response) -> list[dict]:
    """The SSE events, each its `event:` name checked against the data's type."""
    events = []
    for block in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        events.append(data)
    return events


def test_stream_events_raw(http: httpx.Client) -> None:
    req = {"model": SERVED_NAME, "input": ASK, "temperature": 0, "max_output_tokens": 12}
    full = http.post("/v1/responses", json=req).json()
    r = http.post("/v1/responses", json={**req, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in deltas)
    final = events[-1]["response"]
    assert text == events[-4]["text"] == final["output"][0]["content"][0]["text"]
    assert text == full["output"][0]["content"][0]["text"]
    assert final["status"] == full["status"] and final["usage"]["output_tokens"] == full["usage"]["output_tokens"]
    assert final["usage"]["input_tokens"] == full["usage"]["input_tokens"]
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in deltas) and final["output"][0]["id"] == item_id


def test_stream_sdk(client: openai.OpenAI) -> None:
    full = client.responses.create(model=SERVED_NAME, input=ASK, temperature=0, max_output_tokens=12)
    events = list(client.responses.create(model=SERVED_NAME, input=ASK, temperature=0, max_output_tokens=12,
                                          stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text and events[-1].type == "response.completed"
    assert events[-1].response.output_text == text
    if not hasattr(client.responses, "stream"):
        return
    with client.responses.stream(model=SERVED_NAME, input=ASK, temperature=0, max_output_tokens=12) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert final.output_text == text


def test_json_schema_format(client: openai.OpenAI, http: httpx.Client) -> None:
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    ask = "Describe a person as JSON."
    r = client.responses.create(model=SERVED_NAME, input=ask, temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "person", "schema": person,
                                                 "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), person)
    chat = _chat(http, [{"role": "user", "content": ask}], max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}})
    assert r.output_text == chat["choices"][0]["message"]["content"]


def test_sdk_parse_pydantic(client: openai.OpenAI) -> None:
    """The SDK's responses.parse: a pydantic model as text_format (a strict json_schema), the answer parsed."""
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    r = client.responses.parse(model=SERVED_NAME, input="Describe a person as JSON.", text_format=Person,
                               temperature=0, max_output_tokens=60)
    assert r.status == "completed" and isinstance(r.output_parsed, Person)


def test_json_object_format(http: httpx.Client) -> None:
    r = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "Describe Paris as JSON.",
                                         "temperature": 0, "max_output_tokens": 40,
                                         "text": {"format": {"type": "json_object"}}}).json()
    if r["status"] == "completed":
        assert isinstance(json.loads(r["output"][0]["content"][0]["text"]), dict)


def test_function_call_round_trip(client: openai.OpenAI, http: httpx.Client) -> None:
    ask = "What is the weather in Paris?"
    # (one call, room to finish it: the random model's JSON has no reason to be short)
    r = client.responses.create(model=SERVED_NAME, input=ask, tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, temperature=0, max_output_tokens=160)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) >= 1
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required"
    # the chat request of the same conversation calls the same way
    chat = _chat(http, [{"role": "user", "content": ask}], tools=[CHAT_WEATHER], tool_choice="required",
                 parallel_tool_calls=False, max_tokens=160)
    chat_calls = chat["choices"][0]["message"]["tool_calls"]
    assert [(c.name, c.arguments) for c in calls] == [(c["function"]["name"], c["function"]["arguments"])
                                                     for c in chat_calls]
    # turn two: the call and its output as items; the prompt is chat's with the assistant's calls and the tool result
    second = [{"role": "user", "content": ask},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 C."}]
    r2 = client.responses.create(model=SERVED_NAME, input=second, tools=[WEATHER], temperature=0,
                                 max_output_tokens=20)
    chat2 = _chat(http, [{"role": "user", "content": ask},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": call.call_id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 22 C."}],
                  tools=[CHAT_WEATHER], max_tokens=20)
    assert r2.usage.input_tokens == chat2["usage"]["prompt_tokens"]
    assert r2.output_text == (chat2["choices"][0]["message"]["content"] or "")


def test_named_function_stream(http: httpx.Client) -> None:
    req = {"model": SERVED_NAME, "input": "What is the weather in Paris?", "tools": [WEATHER],
           "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0, "max_output_tokens": 40}
    full = http.post("/v1/responses", json=req).json()
    assert [i["type"] for i in full["output"]] == ["function_call"]
    events = _events(http.post("/v1/responses", json={**req, "stream": True}))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == events[-3]["arguments"] == full["output"][0]["arguments"]
    assert events[-1]["response"]["output"][0]["arguments"] == args
    if full["status"] == "completed":
        jsonschema.validate(json.loads(args), WEATHER["parameters"])


def test_required_stream_equals_full(http: httpx.Client) -> None:
    req = {"model": SERVED_NAME, "input": "What is the weather in Paris?", "tools": [WEATHER],
           "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 160}
    full = http.post("/v1/responses", json=req).json()
    events = _events(http.post("/v1/responses", json={**req, "stream": True}))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["status"] == full["status"] == "completed"
    streamed = [(i["type"], i["name"], i["arguments"]) for i in final["output"]]
    assert streamed == [(i["type"], i["name"], i["arguments"]) for i in full["output"]]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["name"], i["arguments"]) for i in done] == streamed
    for i, item in enumerate(done):
        added = [e for e in events if e["type"] == "response.output_item.added" and e["output_index"] == i]
        assert added[0]["item"]["id"] == item["id"] and item["call_id"] and item["status"] == "completed"


def test_disconnect_mid_stream_aborts(server: Server) -> None:
    def running() -> float:
        return metric(httpx.get(server.url + "/metrics", timeout=30).text, "vllm:num_requests_running",
                      model_name=SERVED_NAME)

    with server.client() as c:
        with c.stream("POST", "/v1/responses", json={"input": "Tell me a very long story.", "max_output_tokens": 800,
                                                     "ignore_eos": True, "stream": True}) as r:
            deltas = 0
            for line in r.iter_lines():
                deltas += line == "event: response.output_text.delta"
                if deltas == 5:
                    assert running() == 1
                    break
    deadline = time.monotonic() + 60  # a hang guard
    while running() != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running() == 0


def test_app_path_answers_as_the_hot_route(server: Server, http: httpx.Client) -> None:
    """A browser's request (Origin: the FastAPI app's stack, CORS) generates as the hot route does."""
    req = {"model": SERVED_NAME, "input": ASK, "temperature": 0, "max_output_tokens": 8}
    hot = http.post("/v1/responses", json=req).json()
    app = http.post("/v1/responses", json=req, headers={"Origin": "http://example.test"})
    assert app.status_code == 200 and app.headers["access-control-allow-origin"] == "*"
    assert app.json()["output"][0]["content"] == hot["output"][0]["content"]


@pytest.mark.parametrize("extra, name", [
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "web_search"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "file_search"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "code_interpreter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input_image"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}, "input_file"),
])
def test_refused_fields(http: httpx.Client, extra: dict, name: str) -> None:
    r = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "Hi", "max_output_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert f"'{name}'" in err["message"] and err["type"] == "invalid_request_error"


def test_accepted_defaults(http: httpx.Client) -> None:
    """What SDKs send by default (store, an empty reasoning, truncation disabled) asks for nothing refused."""
    r = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "Hi", "max_output_tokens": 2, "store": True,
                                         "reasoning": {"effort": None}, "truncation": "disabled", "include": [],
                                         "text": {"format": {"type": "text"}}, "user": "u", "top_k": 1, "seed": 3})
    assert r.status_code == 200, r.text
    assert r.json()["store"] is True


@pytest.mark.parametrize("body, status, words", [
    ({"model": "nope", "input": "Hi"}, 404, "nope"),
    ({"model": SERVED_NAME}, 400, "input"),
    ({"model": SERVED_NAME, "input": []}, 400, "input"),
    ({"model": SERVED_NAME, "input": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ({"model": SERVED_NAME, "input": [{"type": "function_call", "name": "f"}]}, 400, "call_id"),
    ({"model": SERVED_NAME, "input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     "schema"),
    # once "text.format.type must be ..., got None." for a format sent as its type's name alone
    ({"model": SERVED_NAME, "input": "Hi", "text": {"format": "json_object"}}, 400,
     "text.format must be an object such as {'type': 'text'}, got 'json_object'."),
    ({"model": SERVED_NAME, "input": "Hi", "tool_choice": "required"}, 400, "tools"),
    ({"model": SERVED_NAME, "input": "Hi", "tools": [{"type": "function"}]}, 400, "name"),
    ({"model": SERVED_NAME, "input": "Hi", "temperature": -1}, 400, "temperature"),
    ({"model": SERVED_NAME, "input": "Hi", "max_output_tokens": 100000}, 400, "context length"),
    # the grammar library's refusal (in the engine) comes back as a 400 naming the field sent, streamed or not
    ({"model": SERVED_NAME, "input": "Hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                               "schema": {"type": "nope"}}}}, 400, "text.format"),
    ({"model": SERVED_NAME, "input": "Hi", "stream": True,
      "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400, "text.format"),
])
def test_bad_requests(http: httpx.Client, body: dict, status: int, words: str) -> None:
    r = http.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


@pytest.mark.parametrize("extra, param", [({"input": "word " * 1500}, "input"),  # (past MAX_MODEL_LEN alone)
                                           ({"input": "Hi", "max_output_tokens": 100000}, "max_output_tokens")])
def test_context_length_names_responses_fields(http: httpx.Client, extra: dict, param: str) -> None:
    """Too long for the context: the error names the Responses fields sent, not chat's messages / max_tokens."""
    r = http.post("/v1/responses", json={"model": SERVED_NAME, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "context length" in err["message"] and "messages" not in err["message"]


@pytest.mark.parametrize("value", [0, -5, 2 ** 70])
def test_bad_max_output_tokens(http: httpx.Client, value: int) -> None:
    r = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "Hi", "max_output_tokens": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_output_tokens"


def test_function_call_output_without_its_call(http: httpx.Client) -> None:
    """OpenAI's 400: an output must answer a function_call made earlier in input."""
    r = http.post("/v1/responses", json={"model": SERVED_NAME, "input": [
        {"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "call_zz", "output": "1"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input[1].call_id" and "call_zz" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool, words", [
    ({"type": "function", "name": "f", "parameters": "x"}, "tools[0].parameters must be a JSON schema object"),
    ({"type": "function", "name": "f", "parameters": {"type": "nope"}}, "tools[0].parameters must describe"),
])
def test_tool_errors_name_the_flat_fields(http: httpx.Client, tool: dict, words: str, stream: bool) -> None:
    """Tools are sent flat ({type, name, parameters}): errors name tools[i].parameters, not chat's nested
    tools[i].function.parameters, which the client never sent."""
    r = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "Hi", "tools": [tool], "stream": stream,
                                         "tool_choice": "required"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and ".function." not in err["message"] + str(err["param"])


def test_malformed_tool_schema_under_auto_is_400(http: httpx.Client) -> None:
    """Once a 200: tool_choice "auto" compiles no grammar, so a schema no JSON schema is went into the prompt."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}
    r = http.post("/v1/responses", json={"model": SERVED_NAME, "input": "Hi", "tools": [tool], "max_output_tokens": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith("Invalid tools[0].parameters: properties.a.type") and err["param"] == "tools"


@pytest.mark.parametrize("text", [None, {}, {"verbosity": "low"}, {"format": None}])
def test_text_echo_has_a_format(http: httpx.Client, text) -> None:
    """The response's text always carries format (plain text when not sent), as OpenAI's does."""
    body = {"model": SERVED_NAME, "input": "Hi", "max_output_tokens": 2, **({} if text is None else {"text": text})}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == {**(text or {}), "format": {"type": "text"}}


def test_auth(server: Server) -> None:
    r = httpx.post(server.url + "/v1/responses", json={"model": SERVED_NAME, "input": "Hi"})
    assert r.status_code == 401
