"""Hostile HTTP against a real server: oversized bodies (413), wrong content types (415), invalid UTF-8 and
broken JSON (400), clients that never read their stream (cut off after --send-timeout while others are
served), and a client that disconnects mid-prefill (aborted at once, its KV blocks freed). Asserted on counts
and order (requests served, /metrics counters); the timeouts are hang guards, not speed bounds."""
from __future__ import annotations

import gzip
import json
import random
import socket
import time

import httpx
import pytest

from robust_helpers import API_KEY, MAX_BODY, SEND_TIMEOUT
from robust_helpers import metric

def _post(server, path: str, content: bytes, content_type: str = "application/json", **headers) -> httpx.Response:
    h = {**server.extra["headers"], "Content-Type": content_type, **headers}
    return httpx.post(server.url + path, content=content, headers=h, timeout=60)


def test_body_over_the_limit_is_413(tiny_server) -> None:
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10), "max_tokens": 1}).encode()
    r = _post(tiny_server, "/v1/completions", big)
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]["message"]
    # chunked upload without a Content-Length: refused while reading
    def chunks():
        for _ in range(MAX_BODY // 4096 + 2):
            yield b" " * 4096
    r = httpx.post(tiny_server.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={**tiny_server.extra["headers"], "Content-Type": "application/json"})
    assert r.status_code == 413
    ok = _post(tiny_server, "/v1/completions", json.dumps({"prompt": "hello world " * 10, "max_tokens": 1}).encode())
    assert ok.status_code == 200


def test_oversized_bodies_get_their_413_every_time(tiny_server) -> None:
    """The server refuses before reading the body, while the client is still sending: the answer must reach the
    client every time (the rest of the body is read and dropped before the close, as nginx's lingering close),
    never a reset (httpx.RemoteProtocolError: "peer closed connection without sending complete message body").
    Bodies of several sizes, with a Content-Length, chunked, and through the openai SDK; 18 tries in all."""
    import openai

    def check(r: httpx.Response) -> None:
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]

    sizes = [MAX_BODY + 1, 2 * MAX_BODY, 5 << 20, 12 << 20]
    with httpx.Client(timeout=60) as client:
        for size in sizes * 3:  # 12 tries with a Content-Length
            check(client.post(tiny_server.url + "/v1/completions", content=b" " * size,
                              headers={**tiny_server.extra["headers"], "Content-Type": "application/json"}))
        for size in (2 * MAX_BODY, 12 << 20, 12 << 20):  # chunked: refused once past the limit, mid-body
            def chunks(size: int = size):
                for _ in range(size // 65536):
                    yield b" " * 65536
            check(client.post(tiny_server.url + "/v1/completions", content=chunks(),
                              headers={**tiny_server.extra["headers"], "Content-Type": "application/json"}))
    sdk = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    for size in (2 * MAX_BODY, 12 << 20, 12 << 20):
        with pytest.raises(openai.APIStatusError) as info:
            sdk.completions.create(model="x", prompt="x" * size, max_tokens=1)
        assert info.value.status_code == 413, info.value
    # and the server still serves, on each of its API processes (connections are spread over them)
    for _ in range(4):
        ok = _post(tiny_server, "/v1/completions", json.dumps({"prompt": "hello", "max_tokens": 1}).encode())
        assert ok.status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "application/xml"])
def test_wrong_content_type_is_415(tiny_server, content_type: str) -> None:
    r = _post(tiny_server, "/v1/chat/completions", b'{"messages": []}', content_type)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]


def test_compressed_body_is_415(tiny_server) -> None:
    body = gzip.compress(json.dumps({"prompt": "hello", "max_tokens": 1}).encode())
    r = _post(tiny_server, "/v1/completions", body, **{"Content-Encoding": "gzip"})
    assert r.status_code == 415 and "Content-Encoding 'gzip'" in r.json()["error"]["message"], r.text
    ok = _post(tiny_server, "/v1/completions", b'{"prompt": "hello", "max_tokens": 1}',
               **{"Content-Encoding": "identity"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("body", [b'{"prompt": "\xff\xfe bad", "max_tokens": 1}', b'{"prompt": "\xc3\x28"}',
                                  b"\xed\xa0\x80", b'\x80{}'])
def test_invalid_utf8_is_400(tiny_server, body: bytes) -> None:
    r = _post(tiny_server, "/v1/completions", body)
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b'"text"', b"null", b'{"prompt": "a", "max_tokens": 1,}',
                                  b"NaN", b'{"prompt": "a"' + b" " * 1000])
def test_broken_json_is_400(tiny_server, body: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        r = _post(tiny_server, path, body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)


@pytest.mark.parametrize("body", [b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
                                  b'{"prompt": "a", "x": [-1' + b"9" * 5000 + b"]}"])
def test_integer_beyond_pythons_digit_limit_is_400(tiny_server, body: bytes) -> None:
    # (int() of more than sys.get_int_max_str_digits() digits is a ValueError, once a 500)
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        r = _post(tiny_server, path, body)
        assert r.status_code == 400 and "an integer with more than 4300 digits" in r.json()["error"]["message"], \
            (path, r.text)


def test_token_ids_and_counts_that_are_not_integers_are_400(tiny_server) -> None:
    # (pydantic's lax ints read true / false / 2.0 as token ids 1 / 0 / 2, and true as max_tokens 1)
    for path, body in [("/v1/completions", {"prompt": [True, False], "max_tokens": 1}),
                       ("/v1/completions", {"prompt": [[5, 6.0]], "max_tokens": 1}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [True]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                 "allowed_token_ids": [5, False]}),
                       ("/detokenize", {"tokens": [True]}),
                       ("/v1/embeddings", {"input": [1, True]}),
                       # nor is a bool a count or a seed
                       ("/v1/completions", {"prompt": "hi", "max_tokens": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": True}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": False})]:
        r = _post(tiny_server, path, json.dumps(body).encode())
        assert r.status_code == 400 and "should be a valid integer" in r.json()["error"]["message"], \
            (path, body, r.text)
    ok = _post(tiny_server, "/v1/completions", json.dumps({"prompt": [5, 6], "max_tokens": 1}).encode())
    assert ok.status_code == 200, ok.text


def test_large_detokenize_bodies_are_decoded_in_a_worker_thread(tiny_server) -> None:
    # (a million ids took seconds to check and decode on the event loop, stalling every stream)
    text = "hello world, " * 20_000
    h = tiny_server.extra["headers"]
    ids = httpx.post(tiny_server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, headers=h,
                     timeout=60).json()["tokens"]
    r = httpx.post(tiny_server.url + "/detokenize", json={"tokens": ids}, headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["prompt"] == text
    r = httpx.post(tiny_server.url + "/detokenize", json={"tokens": ids + [-1]}, headers=h, timeout=60)
    assert r.status_code == 400 and "Token id -1 is out of vocabulary" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b'{"api_key": "\\ud800"}',
                                  b'{"api_key": 1' + b"0" * 5000 + b"}", b"{"])
def test_hostile_dashboard_login_bodies_are_400(tiny_server, body: bytes) -> None:
    r = _post(tiny_server, "/dashboard/login", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "api_key", r.text


def test_json_with_charset_and_no_content_type_are_accepted(tiny_server) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    assert _post(tiny_server, "/v1/completions", body, "application/json; charset=utf-8").status_code == 200
    r = httpx.post(tiny_server.url + "/v1/completions", content=body, headers=tiny_server.extra["headers"], timeout=60)
    assert r.status_code == 200


def _metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=30).text


def _cut_off(server) -> bool:
    return "(--send-timeout): cut off" in server.log()


def test_client_that_never_reads_is_cut_off_without_stalling_others(tiny_server) -> None:
    import select

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a tiny window: the server's writes block soon
    sock.connect(("127.0.0.1", tiny_server.port))
    # ~8 MB of SSE (16 choices x 450 tokens with 20 logprobs each): more than every buffer on the way holds
    body = json.dumps({"prompt": "hi", "max_tokens": 450, "ignore_eos": True, "stream": True, "logprobs": 20,
                       "n": 16}).encode()
    auth = tiny_server.extra["headers"]["Authorization"].encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                 + auth + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        # The server writes into a window that never opens again (the response cannot fit) until --send-timeout
        # cuts the client off. Other requests must be served meanwhile. Which ones were, by order alone: the cut-off
        # comes SEND_TIMEOUT after the blocked write began, so a request that started after (first sight of the
        # cut-off - SEND_TIMEOUT) and was answered before the log said "cut off" was served while that write was
        # blocked. A server that waited on the slow client would answer none of them.
        assert select.select([sock], [], [], 120)[0], "the slow client's response never started"  # a hang guard
        answered = []  # start times of the requests answered before the cut-off
        deadline = time.monotonic() + 240  # a hang guard: the cut-off comes --send-timeout after the block
        while True:
            assert time.monotonic() < deadline, ("the slow client was never cut off", tiny_server.log()[-2000:])
            started = time.monotonic()
            r = httpx.post(tiny_server.url + "/v1/completions", headers=tiny_server.extra["headers"], timeout=120,
                           json={"prompt": "x", "max_tokens": 8, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
            if _cut_off(tiny_server):
                seen_cut = time.monotonic()
                break
            answered.append(started)
        while_blocked = [t for t in answered if t >= seen_cut - SEND_TIMEOUT]
        print(f"answered while the slow client's write was blocked: {len(while_blocked)} (before the cut-off: "
              f"{len(answered)})")
        assert while_blocked, answered
        sock.settimeout(60)  # a hang guard
        received = b""
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break  # the server closed the connection
            received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received  # cut off, not finished
        deadline = time.monotonic() + 60  # a hang guard
        while metric(_metrics(tiny_server), "vllm:num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(_metrics(tiny_server), "vllm:num_requests_running") == 0
        assert metric(_metrics(tiny_server), "vllm:kv_cache_usage_perc") == 0
    finally:
        sock.close()


def _send_and_hang_up_once_queued(server, body: dict, count: int = 1) -> tuple[bool, bytes]:
    """Send a request, wait until the engine holds `count` requests (its prompts), hang up. (False, what the server
    sent) if a response byte (or the connection's end) came first, or the engine never held them."""
    import select

    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: " + server.extra["headers"]["Authorization"].encode()
                     + b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        deadline = time.monotonic() + 120  # a hang guard
        while time.monotonic() < deadline:
            if select.select([sock], [], [], 0)[0]:
                sock.settimeout(5)
                try:
                    return False, sock.recv(4096) or b"<connection closed>"
                except OSError as e:
                    return False, f"<{e!r}>".encode()
            text = _metrics(server)
            if metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting") >= count:
                return True, b""
        return False, b"<the engine never held them>"
    finally:
        sock.close()


def test_disconnect_mid_prefill_frees_kv_at_once(tiny_server) -> None:
    """Counts and order, not seconds: the client hangs up once the engine holds its request; the request is then
    aborted (every prompt counted as an abort, none finished), KV and queues go back to zero, and the work it was
    asked for was cut short, before its prefill was done."""
    # 384 distinct 160-token prompts (no prefix-cache sharing, a small body the API process hands over quickly): 256
    # run at once (--max-num-seqs) and take ~20 prefill steps of 2048 tokens (the CPU default), then 352 decode steps
    # (to max_model_len) before any can finish; the other 128 cannot start before that. The abort reaches the engine
    # at its next step, long before either. (30 tokens after 480-token prompts left too few steps: on a loaded
    # 2-core machine the whole batch was done before the client's /metrics poll saw it queued.)
    rng = random.Random(0)
    prompt_len, max_tokens = 160, 352
    prompts = [[rng.randrange(2, 512) for _ in range(prompt_len)] for _ in range(384)]
    before = _metrics(tiny_server)
    counts0 = {name: metric(before, name) for name in (
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_count")}
    aborted0 = metric(before, "vllm:request_success_total", finished_reason="abort")
    # (hung up once every prompt is in the engine: one the API process had not yet handed over when the client left
    # is never started, not aborted)
    queued, answer = _send_and_hang_up_once_queued(tiny_server, {"prompt": prompts, "max_tokens": max_tokens},
                                                   len(prompts))
    assert queued, (answer[:2000], tiny_server.log()[-3000:])
    deadline = time.monotonic() + 120  # a hang guard, not the "at once" (which is counted below)
    while True:
        text = _metrics(tiny_server)
        freed = (metric(text, "vllm:request_success_total", finished_reason="abort") >= aborted0 + len(prompts)
                 and metric(text, "vllm:num_requests_running") == 0
                 and metric(text, "vllm:num_requests_waiting") == 0
                 and metric(text, "vllm:kv_cache_usage_perc") == 0)
        if freed or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert freed, text
    delta = {name: metric(text, name) - value for name, value in counts0.items()}
    # Every prompt ended as an abort: none finished (a length finish would count as a success too).
    assert delta["vllm:request_success_total"] == len(prompts), delta
    # Cut short during the prefill: not every prompt token was prefilled, not every prompt got a first token, and
    # far from every requested token was generated.
    assert delta["vllm:prompt_tokens_total"] < prompt_len * len(prompts), delta
    assert delta["vllm:time_to_first_token_seconds_count"] < len(prompts), delta
    assert delta["vllm:generation_tokens_total"] < max_tokens * len(prompts), delta
    print(f"disconnect mid-prefill: {delta}")
