"""A grammar after the reasoning through a real `pagedllm serve` and the `openai` client: the answer's think block is
free (`reasoning_content`), the part after `</think>` follows response_format / a required tool_choice (`content`,
`tool_calls`), streamed and not.

The tiny random model never writes `</think>`, so its tokenizer is given one: the added token its free answer emits
a few tokens in is renamed `</think>` (its ids, and so the model's answer, stay the same)."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from e2e_helpers import serving

openai = pytest.importorskip("openai")

# (it names `tools` without writing them: a request with tools renders the same prompt, so the same free answer)
THINKING = "{# tools #}{% for m in messages %}{{ m['content'] }}\n{% endfor %}<think>\n"
MESSAGES = [{"role": "user", "content": "hello"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["paris", "rome"]}}, "required": ["city"]}}}]


def _rename(model_dir: str, token_id: int, text: str) -> None:
    """The added token `token_id` becomes `text` in the tokenizer's files."""
    for name, key in (("tokenizer.json", "added_tokens"), ("tokenizer_config.json", "added_tokens_decoder")):
        path = f"{model_dir}/{name}"
        with open(path) as f:
            data = json.load(f)
        if key == "added_tokens":
            (entry,) = [t for t in data[key] if t["id"] == token_id]
        elif str(token_id) in data.get(key, {}):
            entry = data[key][str(token_id)]
        else:
            continue
        entry["content"] = text
        with open(path, "w") as f:
            json.dump(data, f)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, e2e_env: dict, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasongrammar")
    (tmp / "thinking.jinja").write_text(THINKING)
    model = str(tmp / "model")
    shutil.copytree(tiny_llama_dir, model)
    flags = ["--chat-template", str(tmp / "thinking.jinja"), "--kv-cache-memory-bytes", str(32 << 20)]
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 0, "return_token_ids": True}
    with serving(model, flags, str(tmp / "free.log"), e2e_env) as url:
        free = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    with open(f"{model}/tokenizer.json") as f:
        extras = {t["id"] for t in json.load(f)["added_tokens"] if t["content"].startswith("<|extra_")}
    at = next(i for i in range(3, len(free)) if free[i] in extras and free[i] not in free[:i])
    _rename(model, free[at], "</think>")
    # vLLM's key alone stands for --reasoning-parser; no free whitespace, so the random model's JSON ends
    config = json.dumps({"reasoning_parser": "qwen3", "disable_any_whitespace": True})
    with serving(model, flags + ["--structured-outputs-config", config], str(tmp / "server.log"), e2e_env) as url:
        yield url, free, at


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)


def _stream(client, **kw) -> tuple[str, str, list, str]:
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def test_json_schema_after_the_reasoning(server) -> None:
    url, free, at = server
    client = _client(url)
    kw = dict(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=80, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    full = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    choice = full.choices[0]
    assert choice.model_extra["token_ids"][:at + 1] == free[:at + 1]  # the reasoning was not masked
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning
    answer = json.loads(choice.message.content)
    assert set(answer) == {"name", "age"} and choice.finish_reason == "stop"
    streamed = _stream(client, **kw)
    assert streamed[:2] == (reasoning, choice.message.content) and streamed[3] == "stop"


def test_reasoning_cut_by_max_tokens(server) -> None:
    url, free, at = server
    client = _client(url)
    full = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=at,
                                          temperature=0, response_format={"type": "json_object"})
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"]


def test_tool_choice_required_after_the_reasoning(server) -> None:
    url, _, _ = server
    client = _client(url)
    kw = dict(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=300, temperature=0,
              tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.message.model_extra["reasoning_content"]
    assert choice.message.tool_calls, choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("paris", "rome")
    assert choice.finish_reason == "tool_calls"
    reasoning, content, calls, finish = _stream(client, **kw)
    assert reasoning == choice.message.model_extra["reasoning_content"] and finish == "tool_calls"
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]


def test_responses_json_schema_after_the_reasoning(server) -> None:
    """/v1/responses shares the chat path: a reasoning item, then the message with the JSON."""
    url, _, _ = server
    client = _client(url)
    resp = client.responses.create(model=client.models.list().data[0].id, input="hello", max_output_tokens=80,
                                   temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                                   "schema": SCHEMA}})
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert set(json.loads(resp.output_text)) == {"name", "age"}
