"""vLLM's return_token_ids on both endpoints, streamed and not: completions put `prompt_token_ids` and `token_ids`
on each choice (streamed: the prompt's on a choice's first chunk only, each chunk's new ids); chat puts
`prompt_token_ids` on the response (streamed: on the first chunk, at its top level) and `token_ids` on each choice.
The ids are checked against /tokenize, against /detokenize of the text, and across streamed and whole answers."""
from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai", reason="part of these tests call the server with the openai SDK")

from e2e_helpers import API_KEY, SERVED_NAME, Server  # noqa: E402

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPTS = ["The capital of France is", "Water boils at"]
MESSAGES = [{"role": "user", "content": "Name three colours."}]


def _tokenize(http: httpx.Client, **body) -> list[int]:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _detokenize(http: httpx.Client, ids: list[int]) -> str:
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def _events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completions_whole_and_streamed(http: httpx.Client) -> None:
    body = {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    r = http.post(CMPL, json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for prompt, choice in zip(PROMPTS, choices):
        assert choice["prompt_token_ids"] == _tokenize(http, prompt=prompt)
        assert 0 < len(choice["token_ids"]) <= 8
        assert _detokenize(http, choice["token_ids"]) == choice["text"]
    assert r.json()["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)

    streamed: dict[int, dict] = {}
    for event in _events(http, CMPL, body):
        for c in event["choices"]:
            seen = streamed.setdefault(c["index"], {"prompt": [], "ids": [], "text": ""})
            if "prompt_token_ids" in c:
                seen["prompt"].append(c["prompt_token_ids"])
            seen["ids"] += c["token_ids"]
            seen["text"] += c["text"]
    for choice in choices:
        seen = streamed[choice["index"]]
        assert seen["prompt"] == [choice["prompt_token_ids"]]  # on the choice's first chunk only
        assert (seen["ids"], seen["text"]) == (choice["token_ids"], choice["text"])


def test_chat_whole_and_streamed(http: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    prompt_ids = _tokenize(http, messages=MESSAGES)
    assert data["prompt_token_ids"] == prompt_ids and len(prompt_ids) == data["usage"]["prompt_tokens"]
    (choice,) = data["choices"]
    assert len(choice["token_ids"]) == data["usage"]["completion_tokens"]
    assert _detokenize(http, choice["token_ids"]) == choice["message"]["content"]

    events = _events(http, CHAT, body)
    assert events[0]["prompt_token_ids"] == prompt_ids  # top level, first chunk only
    assert all("prompt_token_ids" not in e for e in events[1:])
    ids = [t for e in events[1:] for c in e["choices"] for t in c["token_ids"]]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert (ids, text) == (choice["token_ids"], choice["message"]["content"])


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_absent_unless_asked(http: httpx.Client, path: str) -> None:
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPTS[0]}
    for flag in ({}, {"return_token_ids": False}):
        body = {**base, "max_tokens": 3, **flag}
        text = http.post(path, json=body).text + json.dumps(_events(http, path, body))
        assert "token_ids" not in text


def test_openai_sdk_extra_body(server: Server, http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    extra = {"return_token_ids": True}
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                  extra_body=extra)
    choice = r.choices[0]
    assert choice.prompt_token_ids == _tokenize(http, prompt=PROMPTS[1])
    assert _detokenize(http, choice.token_ids) == choice.text and len(choice.token_ids) == r.usage.completion_tokens

    c = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                       extra_body=extra)
    assert c.prompt_token_ids == _tokenize(http, messages=MESSAGES)
    assert _detokenize(http, c.choices[0].token_ids) == c.choices[0].message.content

    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                                 stream=True, extra_body=extra))
    assert chunks[0].prompt_token_ids == c.prompt_token_ids
    assert [t for ch in chunks[1:] for choice in ch.choices for t in choice.token_ids] == c.choices[0].token_ids


def test_streamed_tool_call_carries_every_token_id(http: httpx.Client) -> None:
    """A "required" call's text is held back until it parses (here until max_tokens ends it); the ids of the tokens
    held back go out with the next chunk sent, so the stream carries all of them, in order, as the full answer."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [weather],
            "tool_choice": "required", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    full = r.json()["choices"][0]["token_ids"]
    streamed = [t for e in _events(http, CHAT, body) for c in e["choices"] for t in c.get("token_ids", [])]
    assert len(full) == 12 and streamed == full
