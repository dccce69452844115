"""--reasoning-parser through a real `pagedllm serve` (a tiny random model: its answers never close a think block, so
the split itself is covered by tests/unit/test_reasoning_parser.py): a prompt whose template opens `<think>` makes the
whole answer reasoning, streamed and not alike; without it the answer is content; include_reasoning false turns the
split off; a grammar (response_format) waits for the reasoning; an assistant's earlier reasoning reaches the
template."""
from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from e2e_helpers import cli, serving

THINKING = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}<think>\n"  # the server's --chat-template
PLAIN = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
HISTORY = "{% for m in messages %}[{{ m.get('reasoning_content', '') }}|{{ m['content'] }}]{% endfor %}"


@pytest.fixture(scope="module")
def reasoning_server(tiny_llama_dir: str, e2e_env: dict, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning")
    (tmp / "thinking.jinja").write_text(THINKING)
    with serving(tiny_llama_dir, ["--reasoning-parser", "qwen3", "--chat-template", str(tmp / "thinking.jinja"),
                                  "--trust-request-chat-template", "--kv-cache-memory-bytes", str(32 << 20)],
                 str(tmp / "server.log"), e2e_env) as url:
        yield url


@pytest.fixture()
def http(reasoning_server: str):
    with httpx.Client(base_url=reasoning_server, timeout=120) as client:
        yield client


def _body(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, **extra}


def _streamed(http: httpx.Client, body: dict) -> tuple[str, str, list[dict]]:
    reasoning = content = ""
    events = []
    with http.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    for e in events:
        for ch in e["choices"]:
            reasoning += ch["delta"].get("reasoning") or ""
            content += ch["delta"].get("content") or ""
    return reasoning, content, events


def test_an_opened_think_block_makes_the_answer_reasoning(http: httpx.Client) -> None:
    full = http.post("/v1/chat/completions", json=_body()).json()
    message = full["choices"][0]["message"]
    assert message["reasoning"] and message["reasoning"] == message["reasoning_content"]
    assert message["content"] is None and full["usage"]["completion_tokens"] == 12
    reasoning, content, events = _streamed(http, _body())
    assert reasoning == message["reasoning"] and content == ""
    assert all(ch["delta"].get("reasoning") == ch["delta"].get("reasoning_content")
               for e in events for ch in e["choices"])


def test_without_a_think_block_the_answer_is_content(http: httpx.Client) -> None:
    plain = http.post("/v1/chat/completions", json=_body(chat_template=PLAIN)).json()["choices"][0]["message"]
    assert plain["reasoning"] is None and plain["content"]
    reasoning, content, _ = _streamed(http, _body(chat_template=PLAIN))
    assert reasoning == "" and content == plain["content"]


def test_the_split_turned_off(http: httpx.Client) -> None:
    message = http.post("/v1/chat/completions", json=_body(include_reasoning=False)).json()
    assert message["choices"][0]["message"]["reasoning"] is None


def test_a_grammar_waits_for_the_reasoning(http: httpx.Client) -> None:
    """response_format: the grammar starts after `</think>`, which this model never writes: all reasoning, no content
    (tests/e2e/test_reasoning_grammar.py has a model that ends its reasoning)."""
    full = http.post("/v1/chat/completions", json=_body(response_format={"type": "json_object"})).json()
    message = full["choices"][0]["message"]
    plain = http.post("/v1/chat/completions", json=_body()).json()["choices"][0]["message"]
    assert message["reasoning"] == plain["reasoning"] and message["content"] is None


def test_beam_search_answers_are_split_too(http: httpx.Client) -> None:
    """use_beam_search goes through the reasoning parser as the sampling path does (vLLM's full chat response):
    each beam's think block is its reasoning, not content (it was all content, `reasoning` missing)."""
    body = _body(use_beam_search=True, n=2, max_tokens=6)
    del body["temperature"]
    choices = http.post("/v1/chat/completions", json=body).json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        message = choice["message"]
        assert message["reasoning"] and message["reasoning"] == message["reasoning_content"], message
        assert message["content"] is None
    plain = http.post("/v1/chat/completions", json=dict(body, chat_template=PLAIN)).json()["choices"]
    assert all(c["message"]["reasoning"] is None and c["message"]["content"] for c in plain)
    off = http.post("/v1/chat/completions", json=dict(body, include_reasoning=False)).json()["choices"]
    assert all(c["message"]["reasoning"] is None for c in off)


def test_earlier_reasoning_reaches_the_template(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning_content": "thought one"},
                {"role": "assistant", "content": "b", "reasoning": "thought two"}]
    r = http.post("/tokenize", json={"messages": messages, "chat_template": HISTORY, "add_generation_prompt": False})
    ids = r.json()["tokens"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "[|q][thought one|a][thought two|b]" in text, text


def test_responses_api_answers_with_a_reasoning_item(http: httpx.Client) -> None:
    body = {"input": "hello", "max_output_tokens": 10, "temperature": 0}
    full = http.post("/v1/responses", json=body).json()
    (item,) = full["output"]
    assert item["type"] == "reasoning" and item["content"][0]["type"] == "reasoning_text" and item["summary"] == []
    assert item["status"] == full["status"] == "incomplete"  # cut off while thinking
    assert full["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    events = []
    with http.stream("POST", "/v1/responses", json=dict(body, stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == item["content"][0]["text"]
    done = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert len(done) == 1 and done[0]["text"] == deltas
    streamed = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and [o["type"] for o in streamed["output"]] == ["reasoning"]
    assert streamed["usage"] == full["usage"]
    # the reasoning item sent back in the next turn's input is the assistant's earlier reasoning, not an error
    follow = {"input": [{"role": "user", "content": "hello"}, item,
                        {"role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
                        {"role": "user", "content": "and?"}], "max_output_tokens": 2}
    assert http.post("/v1/responses", json=follow).status_code == 200


def test_the_chat_client_shows_the_reasoning_on_stderr(reasoning_server: str, http: httpx.Client,
                                                       e2e_env: dict) -> None:
    """`pagedllm chat`: the answer on stdout, a thinking model's reasoning on stderr as it streams."""
    body = _body(max_tokens=6)
    want = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["reasoning"]
    r = subprocess.run([cli("pagedllm"), "chat", "--url", reasoning_server + "/v1", "--max-tokens", "6",
                        "--temperature", "0", "-q", "hello"], capture_output=True, text=True, env=e2e_env, timeout=120)
    assert r.returncode == 0, r.stderr
    # (whitespace aside: text mode reads a random model's "\r" as a newline)
    assert "".join(want.split()) in "".join(r.stderr.split()) and r.stdout.strip() == "", r.stderr
