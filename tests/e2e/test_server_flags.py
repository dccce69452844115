"""Serve flags reach the server: --generation-config DIR (defaults only where a request is silent, logged at
start), --max-logprobs, --no-enable-chunked-prefill, --no-dashboard, --trust-request-chat-template,
--enable-prompt-tokens-details, --enable-request-id-headers, --return-tokens-as-token-ids,
--enable-server-load-tracking, --chat-template-content-format, --enable-force-include-usage,
--exclude-tools-when-tool-choice-none, --response-role, --log-error-stack,
--enable-tokenizer-info-endpoint, --h11-max-incomplete-event-size, --middleware,
--enable-log-requests --enable-log-outputs --max-log-len, on one real
`pagedllm serve` started with them; --chat-template FILE."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import httpx
import pytest

from e2e_helpers import cli, stop

from pagedllm import SamplingParams
from pagedllm.entrypoints.server_process import free_port, wait_healthy

PROMPT = "The capital of France is"
# --middleware's module: a pure ASGI class and an HTTP function, each tagging every response
MIDDLEWARE_MODULE = """
class TagHeader:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + [(b"x-mw-class", b"1")]
            await send(message)
        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


async def tag_call(request, call_next):
    response = await call_next(request)
    response.headers["x-mw-func"] = request.url.path
    return response
"""
H11_LIMIT = 64 << 10  # --h11-max-incomplete-event-size of the flags server
MAX_LOG_LEN = 24  # --max-log-len of the flags server: cuts a long output's text and token ids
SERVER_TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


@pytest.fixture(scope="module")
def flag_server(smollm2_hf_dir: str, e2e_env: dict, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flags")
    (tmp / "gen").mkdir()
    (tmp / "gen" / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    (tmp / "chat.jinja").write_text(SERVER_TEMPLATE)
    (tmp / "flag_middleware.py").write_text(MIDDLEWARE_MODULE)
    env = dict(e2e_env, PYTHONPATH=os.pathsep.join(p for p in (str(tmp), e2e_env.get("PYTHONPATH")) if p))
    port = free_port()
    log_path = str(tmp / "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([cli("pagedllm"), "serve", smollm2_hf_dir, "--port", str(port), "--generation-config",
                                 str(tmp / "gen"), "--max-logprobs", "3", "--no-enable-chunked-prefill",
                                 "--max-model-len", "512", "--max-num-seqs", "4",
                                 "--kv-cache-memory-bytes", str(64 << 20), "--no-dashboard",
                                 "--trust-request-chat-template", "--chat-template", str(tmp / "chat.jinja"),
                                 "--enable-prompt-tokens-details", "--enable-request-id-headers",
                                 "--return-tokens-as-token-ids", "--enable-server-load-tracking",
                                 "--chat-template-content-format", "string", "--enable-force-include-usage",
                                 "--exclude-tools-when-tool-choice-none", "--response-role", "bot",
                                 "--enable-prompt-embeds", "--log-error-stack", "--enable-tokenizer-info-endpoint",
                                 "--h11-max-incomplete-event-size", str(H11_LIMIT),
                                 "--middleware", "flag_middleware.TagHeader",
                                 "--middleware", "flag_middleware.tag_call",
                                 "--enable-log-requests", "--enable-log-outputs", "--max-log-len", str(MAX_LOG_LEN)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path=log_path)
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client, log_path
    finally:
        stop(proc)


def test_generation_config_dir_defaults(flag_server, offline_llm) -> None:
    http, log_path = flag_server
    log = open(log_path).read()
    assert "{'temperature': 0.0, 'max_tokens': 3}" in log and "Chunked prefill is off" in log
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    greedy = offline_llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=5),
                                  use_tqdm=False)[0].outputs[0]
    silent = http.post("/v1/completions", json={"prompt": ids}).json()
    assert silent["usage"]["completion_tokens"] == 3  # the file's max_new_tokens, not the endpoint's 16
    assert greedy.text.startswith(silent["choices"][0]["text"])  # the file's temperature 0
    own = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 5}).json()
    assert own["usage"]["completion_tokens"] == 5 and own["choices"][0]["text"] == greedy.text
    sampled = {http.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 1.5,
                                                  "seed": s}).json()["choices"][0]["text"] for s in range(4)}
    assert len(sampled) > 1  # the request's own temperature wins over the file's 0



def test_generation_config_max_tokens_is_clamped_to_the_context(flag_server) -> None:
    """The file's max_new_tokens (3) is the server's default, not the request's ask: a prompt that leaves less room
    runs to the context's end (vLLM's get_max_tokens clamps it), where it was a 400 blaming max_tokens. A request's
    own max_tokens past the context is still the 400 naming the lengths."""
    http, _ = flag_server
    prompt = [1000 + i for i in range(511)]
    r = http.post("/v1/completions", json={"prompt": prompt, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1 and r.json()["choices"][0]["finish_reason"] == "length"
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    assert r.status_code == 400 and "(511 in the prompt, 3 in the completion)" in r.json()["error"]["message"]
    words = 500
    while True:  # a conversation whose rendered prompt leaves 1 or 2 tokens of room
        messages = [{"role": "user", "content": "a " * words}]
        count = http.post("/tokenize", json={"messages": messages}).json()["count"]
        if count >= 510:
            break
        words += 510 - count
    assert count < 512
    for path in ("/v1/chat/completions", "/v1/responses"):
        body = {"messages": messages} if path == "/v1/chat/completions" else {"input": messages}
        r = http.post(path, json={**body, "ignore_eos": True})
        assert r.status_code == 200, (path, r.text)
        usage = r.json()["usage"]
        assert usage.get("completion_tokens", usage.get("output_tokens")) == 512 - count
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})
    assert r.status_code == 400 and f"({count} in the messages, 3 in the completion)" in r.json()["error"]["message"]


def test_generation_config_max_tokens_bounds_beam_search(flag_server) -> None:
    """Beam search takes the file's max_new_tokens (3) where a request is silent, as sampling does: chat's ran to the
    context's end and completions' took the endpoint's 16. Near the context's end the search stops there."""
    http, _ = flag_server
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Count to twenty"}],
                                                   "use_beam_search": True, "n": 1, "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 3
    prompts = [[1000 + i for i in range(10)], [1000 + i for i in range(511)]]
    r = http.post("/v1/completions", json={"prompt": prompts, "use_beam_search": True, "n": 1, "ignore_eos": True,
                                           "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert [len(c["token_ids"]) for c in r.json()["choices"]] == [3, 1]
    assert r.json()["usage"]["completion_tokens"] == 4

def test_max_logprobs_flag(flag_server) -> None:
    http, _ = flag_server
    ok = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                 "logprobs": True, "top_logprobs": 3})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logprobs": 4})
    assert r.status_code == 400 and "between 0 and 3" in r.json()["error"]["message"]


def test_long_prompt_runs_without_chunking(flag_server) -> None:
    http, _ = flag_server
    r = http.post("/v1/completions", json={"prompt": [1000 + i for i in range(480)], "max_tokens": 4,
                                           "ignore_eos": True})
    usage = r.json()["usage"]
    assert r.status_code == 200 and {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        "prompt_tokens": 480, "completion_tokens": 4, "total_tokens": 484}


def test_prompt_tokens_details_count_prefix_cache_hits(flag_server) -> None:
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, whole and streamed, both endpoints."""
    http, _ = flag_server
    prompt = [2000 + i for i in range(100)]
    first = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()["usage"]
    again = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["prompt_tokens_details"]["cached_tokens"] == 96  # its full 16-token blocks
    with http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "stream": True,
                                                      "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}
    chat = {"messages": [{"role": "user", "content": "cache me " * 30}], "max_tokens": 2}
    http.post("/v1/chat/completions", json=chat)
    usage = http.post("/v1/chat/completions", json=chat).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16


def test_no_dashboard_flag(flag_server) -> None:
    http, log_path = flag_server
    for path in ("/dashboard", "/dashboard/events", "/dashboard/assets/dashboard.js"):
        r = http.get(path)
        assert r.status_code == 404 and r.json()["error"]["message"] == "Not found: no such route.", path
    assert "Dashboard:" not in open(log_path).read()  # the start-up line that names the page's URL


def test_chat_template_flag(flag_server) -> None:
    """--chat-template FILE renders every chat request that brings no template of its own (vLLM's flag)."""
    http, _ = flag_server
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    plain = http.post("/tokenize", json={"prompt": "<<Hi>>", "add_special_tokens": False}).json()["tokens"]
    assert r.status_code == 200 and r.json()["tokens"] == plain, r.text


def test_trust_request_chat_template_flag(flag_server) -> None:
    """With the flag a request's own chat template renders the messages (without it: a 400, test_http.py)."""
    http, _ = flag_server
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}], "chat_template": template})
    assert r.status_code == 200, r.text
    plain = http.post("/tokenize", json={"prompt": "[Hi]", "add_special_tokens": False}).json()["tokens"]
    assert r.json()["tokens"] == plain
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                   "chat_template": template})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(plain)


def test_chat_template_content_format_flag(flag_server) -> None:
    """--chat-template-content-format string: content reaches even a template that loops over a message's
    content as one string, text parts joined by newlines ("auto", the default, would hand it the parts)."""
    http, _ = flag_server
    template = ("{% for m in messages %}{% if m['content'] is string %}S({{ m['content'] }}){% else %}"
                "{% for p in m['content'] %}L({{ p['text'] }}){% endfor %}{% endif %}{% endfor %}")
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": parts}], "chat_template": template})
    plain = http.post("/tokenize", json={"prompt": "S(Hi\nthere)", "add_special_tokens": False}).json()["tokens"]
    assert r.status_code == 200 and r.json()["tokens"] == plain, r.text


def test_request_id_headers_and_token_ids_default(flag_server) -> None:
    http, _ = flag_server
    mine = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "trace-7"})
    assert mine.headers["x-request-id"] == "trace-7"
    new = http.get("/v1/models")
    assert len(new.headers["x-request-id"]) == 32  # one made for it
    with http.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "max_tokens": 2, "stream": True}) as r:
        assert r.headers["x-request-id"] and r.read()
    # the request guard's own refusals (outside the app) carry it too
    for content, ctype in ((b'{"prompt": "\xff"}', "application/json"), (b"hi", "text/plain")):
        bad = http.post("/v1/completions", content=content, headers={"content-type": ctype, "X-Request-Id": "t-8"})
        assert bad.status_code in (400, 415) and bad.headers["x-request-id"] == "t-8", bad.text
    lp = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 1}).json()
    assert all(t.startswith("token_id:") for t in lp["choices"][0]["logprobs"]["tokens"])  # the server's default
    own = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 1,
                                             "return_tokens_as_token_ids": False}).json()
    assert not any(t.startswith("token_id:") for t in own["choices"][0]["logprobs"]["tokens"])


def test_server_load_tracking(flag_server) -> None:
    """GET /load (vLLM's) counts the completions in flight: 1 during a stream, 0 once it ended (there was no /load
    route, and the flag was refused)."""
    http, _ = flag_server
    assert http.get("/load").json() == {"server_load": 0}
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        during = http.get("/load").json()
        list(lines)
    assert during == {"server_load": 1}
    # The count drops once the server's part of the request returned, which the --middleware function's task (in
    # this server) may finish just after the client read the last byte: wait for it, within bounds.
    for _ in range(100):
        if http.get("/load").json() == {"server_load": 0}:
            break
        time.sleep(0.05)
    assert http.get("/load").json() == {"server_load": 0}


def test_force_include_usage(flag_server) -> None:
    """--enable-force-include-usage (vLLM's; was refused as unknown): a stream that asked for no usage carries the
    usage so far on every chunk and ends with a usage-only chunk, as vLLM's flag does."""
    http, _ = flag_server
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        r = http.post(path, json=dict(body, max_tokens=3, stream=True))
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert chunks and all(c["usage"] for c in chunks), r.text
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_exclude_tools_when_tool_choice_none(flag_server) -> None:
    """--exclude-tools-when-tool-choice-none (vLLM's): a "none" request's prompt has no tools in it ("auto"'s has)."""
    http, _ = flag_server
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    msgs = [{"role": "user", "content": "Hi"}]
    bare = http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    none = http.post("/tokenize", json={"messages": msgs, "tools": [tool], "tool_choice": "none"}).json()["tokens"]
    auto = http.post("/tokenize", json={"messages": msgs, "tools": [tool]}).json()["tokens"]
    assert none == bare and auto != bare


def test_response_role(flag_server) -> None:
    """--response-role (vLLM's; was refused as unknown): the chat answer's role after a generation prompt."""
    http, _ = flag_server
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"] == "bot"
    chunks = http.post("/v1/chat/completions", json=dict(body, stream=True)).text
    assert '"delta":{"role":"bot"' in chunks, chunks


def _b64_tensor(tensor) -> str:
    import base64
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_prompt_embeds_on_completions(flag_server, offline_llm, smollm2_hf_dir) -> None:
    """--enable-prompt-embeds: /v1/completions' prompt_embeds (vLLM's: base64 of a torch.save'd [num_tokens, hidden]
    tensor, or a list of them, served before any 'prompt'). The model's own embedding rows of some tokens give the
    greedy tokens of those tokens as a prompt; the placeholders they travel with never hit a token prompt's blocks."""
    import glob

    from safetensors import safe_open

    http, _ = flag_server
    ids = offline_llm.get_tokenizer().encode("The capital of France is")
    for path in glob.glob(f"{smollm2_hf_dir}/*.safetensors"):
        with safe_open(path, "pt") as f:
            if "model.embed_tokens.weight" in f.keys():
                rows = f.get_tensor("model.embed_tokens.weight")[ids].float()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = offline_llm.generate([ids], params, use_tqdm=False)[0].outputs[0].text
    body = {"prompt_embeds": [_b64_tensor(rows), _b64_tensor(rows[None])], "prompt": "Hi", "max_tokens": 5,
            "temperature": 0.0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices[:2]] == [want, want] and len(choices) == 3
    assert r.json()["usage"]["prompt_tokens"] == 2 * len(ids) + len(offline_llm.get_tokenizer().encode("Hi"))
    for bad, fragment in [({"prompt_embeds": "not base64!"}, "not valid base64"),
                          ({"prompt_embeds": _b64_tensor(rows[:, :7])}, "hidden size"),
                          ({"prompt_embeds": _b64_tensor(rows), "echo": True}, "'echo' with 'prompt_embeds'"),
                          ({}, "Missing required parameter: 'prompt' (or 'prompt_embeds')")]:
        r = http.post("/v1/completions", json={"max_tokens": 2, **bad})
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text



def test_prompt_embeds_refusals_name_the_field(flag_server) -> None:
    """A prompt_embeds tensor of the wrong width or with NaN / inf is a 400 whose param is 'prompt_embeds', as every
    other prompt_embeds refusal's (the engine's check answered with param null)."""
    import torch

    http, _ = flag_server
    for tensor, fragment in [(torch.zeros(3, 7), "hidden size"), (torch.full((2, 576), float("nan")), "finite"),
                             (torch.full((1, 2, 576), float("inf")), "finite")]:
        r = http.post("/v1/completions", json={"prompt_embeds": _b64_tensor(tensor), "max_tokens": 2})
        error = r.json()["error"]
        assert r.status_code == 400 and fragment in error["message"] and error["param"] == "prompt_embeds", r.text

def test_completion_suffix_refused(flag_server) -> None:
    """vLLM refuses any non-null `suffix`, the empty one included (it was accepted silently); null is no suffix."""
    http, _ = flag_server
    for suffix in ("", " end"):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "suffix": suffix})
        assert r.status_code == 400 and r.json()["error"]["message"] == "suffix is not currently supported", r.text
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "suffix": None}).status_code == 200


def test_log_error_stack(flag_server) -> None:
    """--log-error-stack (vLLM's; was refused as unknown): an error answered as a 4xx logs its stack trace."""
    http, log_path = flag_server
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "suffix": "stack-7"})
    assert r.status_code == 400
    log = open(log_path).read()
    at = log.index("Error response (400): APIError: suffix is not currently supported")
    assert "Traceback (most recent call last)" in log[at:] and "create_completion" in log[at:]


def test_tokenizer_info_endpoint(flag_server) -> None:
    """--enable-tokenizer-info-endpoint (vLLM's; was refused as unknown): GET /tokenizer_info gives the tokenizer's
    configuration as vLLM's does (its 404 without the flag: test_http.py)."""
    http, _ = flag_server
    r = http.get("/tokenizer_info")
    info = r.json()
    assert r.status_code == 200 and info["tokenizer_class"].isidentifier(), r.text  # the class's name
    assert info["chat_template"] == SERVER_TEMPLATE  # --chat-template's
    assert "vocab_file" not in info and "merges_file" not in info
    eos = info["eos_token"]  # an AddedToken shown as its text
    assert isinstance(eos, str) and len(http.post("/tokenize", json={"prompt": eos, "add_special_tokens": False})
                                        .json()["tokens"]) == 1


def test_h11_max_incomplete_event_size(flag_server) -> None:
    """--h11-max-incomplete-event-size (vLLM's; was refused as unknown): the server parses HTTP with h11 under that
    limit: a request whose headers stay incomplete past it is a 400 (httptools, the default, would wait for the
    rest); complete headers under it are served."""
    http, _ = flag_server
    assert http.get("/v1/models", headers={"x-pad": "a" * (H11_LIMIT // 2)}).status_code == 200
    with socket.create_connection((http.base_url.host, http.base_url.port), timeout=60) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-pad: " + b"a" * (H11_LIMIT + 1024))  # no end
        answer = b""
        while chunk := sock.recv(4096):  # the server closes the connection after its answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400") and b"Invalid HTTP request" in answer, answer


def test_middleware_flag(flag_server) -> None:
    """--middleware (vLLM's, repeatable; was refused as unknown): a class and an async function given by import path
    wrap every route, the generating ones (served in front of the app) and streams included."""
    http, _ = flag_server
    for r in (http.get("/v1/models"), http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}),
              http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True}),
              http.get("/no/such/route")):
        assert r.headers["x-mw-class"] == "1" and r.headers["x-mw-func"] == r.url.path, (r.url, r.headers)
    streamed = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 2, "stream": True})
    assert streamed.text.rstrip().endswith("data: [DONE]") and streamed.headers["x-mw-func"]
    # the stream's connection stays usable (its end went through the middlewares, not around them)
    assert http.get("/v1/models").status_code == 200


def _log_wait(log_path: str, needle: str) -> str:
    """The server's log once it holds `needle` (its lines reach the file as they are written)."""
    for _ in range(100):
        log = open(log_path).read()
        if needle in log:
            return log
        time.sleep(0.1)
    return open(log_path).read()


def test_log_requests_and_outputs(flag_server) -> None:
    """--enable-log-requests --enable-log-outputs (vLLM's; were refused as unknown): a line per request received
    (its id and sampling parameters) and one per finished sample with its whole text, token ids and finish reason,
    in vLLM's RequestLogger words (the engine's request id: cmpl-<X-Request-Id>-<8 characters>), streamed ones
    marked "(streaming complete)"; --max-log-len cuts them."""
    http, log_path = flag_server
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body, headers={"X-Request-Id": "log-whole-1"}).json()
    text = whole["choices"][0]["text"]
    log = _log_wait(log_path, "Generated response cmpl-log-whole-1-")
    assert "Received request cmpl-log-whole-1-" in log and ": params: SamplingParams(" in log and "max_tokens=3" in log
    line = next(ln for ln in log.splitlines() if "Generated response cmpl-log-whole-1-" in ln)
    assert f"output: {text!r}, output_token_ids: [" in line and line.endswith("finish_reason: length"), line
    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert str(ids) in line  # (3 tokens that re-tokenize as generated: plain words)

    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "stream": True}
    r = http.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "log-stream-2"})
    parts = [json.loads(ln[6:])["choices"][0]["delta"].get("content") or "" for ln in r.text.splitlines()
             if ln.startswith("data: {") and json.loads(ln[6:])["choices"]]
    log = _log_wait(log_path, "Generated response chatcmpl-log-stream-2-")
    line = next(ln for ln in log.splitlines() if "Generated response chatcmpl-log-stream-2-" in ln)
    assert f" (streaming complete): output: {''.join(parts)!r}, output_token_ids: [" in line, line

    long_body = dict(body, max_tokens=60, prompt="Count: 1, 2, 3, 4,")
    long_text = http.post("/v1/completions", json=long_body, headers={"X-Request-Id": "log-long-3"}).json()
    log = _log_wait(log_path, "Generated response cmpl-log-long-3-")
    line = next(ln for ln in log.splitlines() if "Generated response cmpl-log-long-3-" in ln)
    out = long_text["choices"][0]["text"]
    assert len(out) > MAX_LOG_LEN and f"output: {out[:MAX_LOG_LEN]!r}, output_token_ids: [" in line, line
    logged_ids = line[line.index("output_token_ids: [") + 19:line.index("], finish_reason")].split(", ")
    assert len(logged_ids) == MAX_LOG_LEN


@pytest.mark.parametrize("api_servers", [1, 2])
def test_port_0_logs_the_port_the_server_listens_on(tiny_llama_dir: str, e2e_env: dict, tmp_path,
                                                     api_servers: int) -> None:
    """`--port 0` takes a port the kernel picks: the start log's URLs must name it (one API process logged
    http://127.0.0.1:0/v1, where nobody listens), and the server answers there."""
    import re

    log_path = str(tmp_path / "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([cli("pagedllm"), "serve", tiny_llama_dir, "--port", "0", "--device", "cpu",
                                 "--served-model-name", "tiny", "--enforce-eager", "--kv-cache-memory-bytes",
                                 str(16 << 20), "--api-server-count", str(api_servers)],
                                stdout=log, stderr=subprocess.STDOUT, env=e2e_env)
    try:
        deadline = time.monotonic() + 240  # a hang guard
        while not re.search(r"Dashboard: (\S+)/dashboard", open(log_path).read()):
            assert proc.poll() is None and time.monotonic() < deadline, open(log_path).read()[-3000:]
            time.sleep(0.1)
        text = open(log_path).read()
        urls = re.findall(r"at (http://\S+)/v1", text) + re.findall(r"Dashboard: (\S+)/dashboard", text)
        assert urls and len(set(urls)) == 1, text[-3000:]
        assert not urls[0].endswith(":0"), urls
        assert httpx.get(urls[0] + "/health", timeout=30).status_code == 200
    finally:
        stop(proc)
