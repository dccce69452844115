"""Raw HTTP against `pagedllm serve`: SSE framing, error shapes and statuses, auth, utility endpoints."""
from __future__ import annotations

import json

import httpx
import pytest

from e2e_helpers import API_KEY, MAX_MODEL_LEN, SERVED_NAME, Server

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSG = [{"role": "user", "content": "Say hi."}]


def sse_events(raw: str) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing on the way."""
    assert raw.endswith("\n\n"), "every event ends with a blank line"
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        events.append(block[len("data: "):])
    return events


def test_chat_sse_framing_usage_and_done(http: httpx.Client) -> None:
    r = http.post(CHAT, json={"model": SERVED_NAME, "messages": MSG, "max_tokens": 5, "stream": True,
                              "temperature": 0, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == SERVED_NAME for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completion_sse_without_usage(http: httpx.Client) -> None:
    r = http.post(CMPL, json={"prompt": "Hello", "max_tokens": 3, "stream": True, "ignore_eos": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["choices"] for c in chunks)
    assert "usage" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_multiple_prompts_token_ids_and_unknown_fields(http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
    r = http.post(CMPL, json={"prompt": [ids, "The sky is"], "max_tokens": 4, "temperature": 0,
                              "some_unknown_field": {"x": 1}, "user": "u1", "top_k": 5, "min_p": 0.0,
                              "repetition_penalty": 1.0, "min_tokens": 1, "stop_token_ids": [],
                              "skip_special_tokens": True, "presence_penalty": 0.1, "frequency_penalty": 0.1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"] == body["choices"][1]["text"]  # same tokens, greedy
    assert body["usage"]["prompt_tokens"] == 2 * len(ids)


def test_tokenize_detokenize_version_health(server: Server, http: httpx.Client) -> None:
    t = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == MAX_MODEL_LEN and len(t["token_strs"]) == t["count"]
    assert http.post("/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": MSG}).json()
    assert chat["count"] > t["count"] and chat["token_strs"] is None  # vLLM's key, null when not asked for
    # With tools and a tool-call history: the prompt the chat route renders, token for token
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    history = MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    counted = http.post("/tokenize", json={"messages": history, "tools": tools}).json()["count"]
    used = http.post(CHAT, json={"messages": history, "tools": tools, "max_tokens": 1}).json()["usage"]
    assert counted == used["prompt_tokens"] and counted > chat["count"]
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200


LONG = "hello " * (MAX_MODEL_LEN + 10)
BAD_INPUTS = [
    # (path, raw body or json, status, fragment of the message)
    (CHAT, b"{not json", 400, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, "JSON object"),
    (CHAT, {"model": SERVED_NAME}, 400, "Missing required parameter: 'messages'"),
    (CHAT, {"messages": []}, 400, "at least one message"),
    (CHAT, {"messages": MSG, "n": 0}, 400, "n must be"),
    (CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p must be"),
    (CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature must be"),
    (CHAT, {"messages": MSG, "max_tokens": -1}, 400, "max_tokens must be"),
    (CHAT, {"messages": MSG, "max_tokens": "lots"}, 400, "Invalid value for 'max_tokens'"),
    (CHAT, {"messages": "hello"}, 400, "Invalid value for 'messages'"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "'temperature'"),
    (CHAT, {"messages": MSG, "stop": 5}, 400, "'stop"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "'logprobs' must be set to true"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, f"maximum context length is {MAX_MODEL_LEN} tokens"),
    (CHAT, {"messages": MSG, "max_tokens": MAX_MODEL_LEN}, 400, "in the messages"),
    (CHAT, {"messages": MSG, "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
    (CMPL, {"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    (CMPL, {"max_tokens": 3}, 400, "Missing required parameter: 'prompt'"),
    (CMPL, {"prompt": ""}, 400, "must not be an empty string"),
    (CMPL, {"prompt": [999999999]}, 400, "out of vocabulary"),
    (CMPL, {"prompt": LONG, "max_tokens": 10}, 400, "in the prompt, 10 in the completion"),
    (CMPL, {"prompt": "hello " * 20_000, "max_tokens": 10}, 400, "maximum context length"),  # (tokenized off-loop)
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 20_000}]}, 400, "maximum context length"),
    (CMPL, {"prompt": "x", "logprobs": 50}, 400, "logprobs must be"),
    (CMPL, {"prompt": "x", "n": "two"}, 400, "Invalid value for 'n'"),
    (CMPL, {"prompt": "x", "seed": 2 ** 70}, 400, "seed is out of range"),
    (CMPL, {"prompt": "x", "stop_token_ids": [2 ** 65]}, 400, "stop_token_ids"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "not supported yet"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "Missing required parameter: 'messages.0.role'"),
    ("/v1/nope", {"x": 1}, 404, "Not found"),
    ("/detokenize", {"tokens": [-5]}, 400, "out of vocabulary"),
    ("/tokenize", {}, 400, "exactly one of"),
    (CHAT, {"messages": [MSG[0], {"role": "assistant", "tool_calls": [{"function": "x"}]}, MSG[0]]}, 400,
     "messages[1].tool_calls[0].function must be an object"),
    (CHAT, {"messages": [MSG[0], {"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}, MSG[0]]}, 400,
     "function.name must be a string"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, 400,
     "needs a 'text' string"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "needs a 'text' string"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "refusal", "text": "no"}]}]}, 400,
     "needs a 'refusal' string"),
    (CHAT, {"messages": MSG, "chat_template": "{{ 'x' }}"}, 400, "does not take chat templates"),
    ("/tokenize", {"messages": MSG, "chat_template": "{{ 'x' }}"}, 400, "does not take chat templates"),
    (CHAT, {"messages": MSG, "response_format": {}}, 400, "response_format needs a 'type'"),
    (CMPL, {"prompt": "x", "guided_whitespace_pattern": " "}, 400, "guided_whitespace_pattern shapes"),
    # lone UTF-16 surrogates: valid JSON escapes, not text anything downstream can encode
    (CMPL, b'{"prompt": "\\ud800"}', 400, "lone UTF-16 surrogate"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\udfff"]}', 400, "lone UTF-16 surrogate"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\ud800"}', 400, "lone UTF-16 surrogate"),
    ("/tokenize", b'{"prompt": "\\ud800"}', 400, "lone UTF-16 surrogate"),
]


@pytest.mark.parametrize("path,body,status,fragment", BAD_INPUTS,
                         ids=[f"{i}-{b[0]}-{b[2]}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_inputs(http: httpx.Client, path: str, body, status: int, fragment: str) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}



@pytest.mark.parametrize("path,body,param", [
    (CMPL, {"prompt": LONG, "max_tokens": 10}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}], "max_tokens": 10}, "messages"),
    ("/v1/responses", {"input": LONG, "max_output_tokens": 10}, "input"),
    (CMPL, {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("/v1/responses", {"input": "x", "max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens")])
def test_context_length_error_names_the_field_to_shorten(http: httpx.Client, path: str, body: dict,
                                                         param: str) -> None:
    """A prompt that fills the context alone is a 400 naming the prompt's field, not max_tokens (which it named
    whatever max_tokens was); a prompt that fits but leaves too little room names max_tokens."""
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text

def test_pooling_ids_are_vllms_and_may_repeat(server: Server) -> None:
    """/v1/embeddings and /v1/score name their answers as vLLM: "embd-<id>" / "score-<id>", <id> the X-Request-Id
    header, else request_id; requests of one id at once all run (the engine's ids add random characters)."""
    from concurrent.futures import ThreadPoolExecutor

    def embed(_: int) -> httpx.Response:
        with server.client() as c:
            return c.post("/v1/embeddings", json={"input": ["Hi", "there"], "request_id": "same"})

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(embed, range(4)))
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert {r.json()["id"] for r in answers} == {"embd-same"}
    with server.client() as c:
        r = c.post("/v1/score", json={"text_1": "a", "text_2": "b"}, headers={"X-Request-Id": "hdr"})
    assert r.status_code == 200 and r.json()["id"] == "score-hdr", r.text


def test_invocations_routes_by_the_body(server: Server, http: httpx.Client) -> None:
    """vLLM's SageMaker route POST /invocations (was a 404): a chat body is a chat completion, a prompt a
    completion, an input an embedding; a body no route takes is a 400 naming the request types; behind the key."""
    r = http.post("/invocations", json={"messages": MSG, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    r = http.post("/invocations", json={"prompt": "Hi", "max_tokens": 1, "stream": True})
    assert r.status_code == 200 and '"object":"text_completion"' in r.text and r.text.endswith("data: [DONE]\n\n")
    r = http.post("/invocations", json={"input": "Hi"})
    assert r.status_code == 200 and r.json()["data"][0]["object"] == "embedding", r.text
    r = http.post("/invocations", json={"nothing": 1})
    assert r.status_code == 400 and "Cannot find suitable handler" in r.json()["error"]["message"]
    assert "ChatCompletionRequest" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/invocations", json={"prompt": "Hi", "max_tokens": 1}).status_code == 401


def test_text_like_content_parts_are_text(http: httpx.Client) -> None:
    """As vLLM: input_text / output_text parts (the Responses API's) and an assistant's refusal part (OpenAI's
    assistant content is text or refusal parts) are read as text; they were a 400 'not supported yet'."""
    def conv(user: dict, assistant: dict) -> list:
        return [{"role": "user", "content": [user]}, {"role": "assistant", "content": [assistant]}, MSG[0]]

    plain = conv({"type": "text", "text": "Hi"}, {"type": "text", "text": "I can't."})
    like = conv({"type": "input_text", "text": "Hi"}, {"type": "refusal", "refusal": "I can't."})
    output = conv({"type": "text", "text": "Hi"}, {"type": "output_text", "text": "I can't."})
    tokens = [http.post("/tokenize", json={"messages": m}).json().get("tokens") for m in (plain, like, output)]
    assert tokens[0] and tokens[1] == tokens[0] and tokens[2] == tokens[0]
    r = http.post(CHAT, json={"messages": like, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tokens[0]), r.text


@pytest.mark.parametrize("headers,status", [
    ({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"Authorization": API_KEY}, 401),
    ({"Authorization": f"Bearer {API_KEY}"}, 200)])
def test_auth_on_v1(server: Server, headers: dict, status: int) -> None:
    r = httpx.get(server.url + "/v1/models", headers=headers)
    assert r.status_code == status
    if status == 401:
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.url + CHAT, json={"messages": MSG, "max_tokens": 1}, headers=headers)
    assert r.status_code == status


def test_open_endpoints_without_key(server: Server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ping").status_code == 200 and httpx.post(server.url + "/ping").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/version").status_code == 200
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}  # no --enable-server-load-tracking


def test_tokenizer_info_is_404_without_its_flag(http: httpx.Client) -> None:
    """GET /tokenizer_info exists only with --enable-tokenizer-info-endpoint (as vLLM's)."""
    r = http.get("/tokenizer_info")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not found: no such route."


def test_dev_mode_routes_are_404_without_dev_mode(http: httpx.Client) -> None:
    """Sleep mode's routes and /reset_prefix_cache exist only with PAGEDLLM_SERVER_DEV_MODE / VLLM_SERVER_DEV_MODE
    (as vLLM's): with the key, this server (no dev mode) answers 404."""
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/reset_prefix_cache")):
        assert http.request(method, path).status_code == 404, path


def test_wrong_method_is_405_with_allow(http: httpx.Client) -> None:
    """A route asked with a method it does not take: 405 in the error shape, with the Allow header HTTP requires
    of a 405 (the app's error handler dropped the exception's headers, so Allow was missing)."""
    for method, path, allowed in (("POST", "/health", {"GET"}), ("GET", "/v1/embeddings", {"POST"}),
                                  ("DELETE", f"/v1/models/{SERVED_NAME}", {"GET"}), ("PUT", "/tokenize", {"POST"}),
                                  ("GET", "/v1/load_lora_adapter", {"POST"}), ("DELETE", "/ping", {"GET", "POST"})):
        r = http.request(method, path)
        assert r.status_code == 405, (method, path, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        assert {m.strip() for m in r.headers.get("allow", "").split(",")} == allowed, (method, path, r.headers)
