"""`pagedllm run-batch`: vLLM's offline runner of OpenAI batch files (it was missing: `invalid choice`)."""
from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import sys
import threading
from typing import Iterator

import pytest

from e2e_helpers import cli

from pagedllm.entrypoints.openai.run_batch import parse_line


def run(args: list[str], env: dict, timeout: float = 240, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, input=stdin)


@contextlib.contextmanager
def _file_server(files: dict) -> Iterator[str]:
    """A local HTTP server: GET serves files[path], PUT stores the body in files[path] (batch files by URL)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            data = files.get(self.path)
            self.send_response(200 if data is not None else 404)
            self.end_headers()
            self.wfile.write(data or b"")

        def do_PUT(self) -> None:  # noqa: N802
            files[self.path] = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_run_batch_file(smollm2_hf_dir: str, e2e_env: dict, tmp_path) -> None:
    """One engine start for the whole format: results in input order, each line's own error on its own line."""
    chat = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    lines = [
        _line("chat", "/v1/chat/completions", chat),
        _line("cmpl", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "n": 2,
                                          "logprobs": 1, "temperature": 0, "stop": ["\n"]}),
        "{not json",
        "",  # blank lines are skipped, as vLLM skips them
        _line("bad-url", "/v1/nope", {}),
        _line("chat", "/v1/completions", {"prompt": "x", "max_tokens": 2}),  # a duplicate custom_id
        _line("bad-body", "/v1/completions", {"prompt": "x", "max_tokens": -3}),
        _line("bad-model", "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2}),
        _line("stream", "/v1/chat/completions", dict(chat, stream=True)),
        _line("embed", "/v1/embeddings", {"input": "hello"}),
        _line("json", "/v1/chat/completions", dict(chat, max_tokens=8, response_format={"type": "json_object"})),
        _line("nan", "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": float("nan")}),
    ]
    out = tmp_path / "out.jsonl"
    with _file_server({"/in.jsonl": ("\n".join(lines) + "\n").encode()}) as url:  # the input by URL, as vLLM takes it
        r = run([cli("pagedllm"), "run-batch", "-i", f"{url}/in.jsonl", "-o", str(out), smollm2_hf_dir,
                 "--served-model-name", "smol", "--dtype", "float32", "--max-model-len", "256",
                 "--kv-cache-memory-bytes", "32M", "--enable-log-requests"], e2e_env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Received request" in r.stderr  # serve's flags hold here too (--enable-log-requests did nothing)
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [o["custom_id"] for o in results] == ["chat", "cmpl", None, "bad-url", "chat", "bad-body", "bad-model",
                                                 "stream", "embed", "json", "nan"]
    for o in results:
        assert set(o) == {"id", "custom_id", "response", "error"}, o
        assert set(o["response"]) == {"status_code", "request_id", "body"}, o
        assert (o["error"] is None) == (o["response"]["status_code"] == 200), o
    by = dict(zip(["chat", "cmpl", "badjson", "bad-url", "dup", "bad-body", "bad-model", "stream", "embed", "json",
                   "nan"], results))
    body = by["chat"]["response"]["body"]
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3
    body = by["cmpl"]["response"]["body"]
    assert len(body["choices"]) == 2 and all(c["logprobs"]["tokens"] for c in body["choices"])
    assert all("\n" not in c["text"] for c in body["choices"])
    assert len(by["embed"]["response"]["body"]["data"][0]["embedding"]) > 0
    assert by["json"]["response"]["body"]["choices"][0]["message"]["content"].lstrip().startswith("{")  # its grammar
    assert "not valid JSON" in by["badjson"]["error"]["message"]
    assert "/v1/nope" in by["bad-url"]["error"]["message"]
    assert "duplicate custom_id" in by["dup"]["error"]["message"]
    assert by["bad-body"]["response"]["status_code"] == 400 and by["bad-body"]["error"]["param"] == "max_tokens"
    assert by["bad-model"]["response"]["status_code"] == 404
    assert "stream" in by["stream"]["error"]["message"]
    assert by["nan"]["response"]["status_code"] == 400, by["nan"]  # (was a 500: the client refused to send NaN)


def test_run_batch_run_failures_exit_non_zero(e2e_env: dict, tmp_path) -> None:
    """A missing input file fails at once with one line and a non-zero code (before any engine loads)."""
    r = run([cli("pagedllm"), "run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")],
            e2e_env, timeout=60)
    assert r.returncode == 1 and "cannot read" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    r = run([cli("pagedllm"), "run-batch", "-o", str(tmp_path / "o.jsonl")], e2e_env, timeout=60)
    assert r.returncode == 2 and "--input-file" in r.stderr
    (tmp_path / "in.jsonl").write_text(_line("a", "/v1/completions", {"prompt": "x"}) + "\n")
    r = run([cli("pagedllm"), "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "no" / "o.jsonl")],
            e2e_env, timeout=60)  # refused before the batch runs, not after
    assert r.returncode == 1 and "no such directory" in r.stderr, r.stderr[-2000:]
    # -o naming a folder: was refused only when written, after the batch ran (an empty input: a traceback)
    (tmp_path / "empty-in.jsonl").write_text("")
    for name in ("in.jsonl", "empty-in.jsonl"):
        r = run([cli("pagedllm"), "run-batch", "-i", str(tmp_path / name), "-o", str(tmp_path),
                 str(tmp_path / "no-model")], e2e_env, timeout=60)
        assert r.returncode == 1 and "is a directory" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    # an empty file: an empty output, no model loaded (a model that does not exist is not even looked at)
    (tmp_path / "empty.jsonl").write_text("\n")
    r = run([cli("pagedllm"), "run-batch", "-i", str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "o.jsonl"),
             str(tmp_path / "no-model")], e2e_env, timeout=60)
    assert r.returncode == 0 and (tmp_path / "o.jsonl").read_text() == "", r.stderr[-2000:]
    # the same with a UTF-8 byte-order mark (was a line of its own: the model loaded for one failed line)
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf\n")
    r = run([cli("pagedllm"), "run-batch", "-i", str(tmp_path / "bom.jsonl"), "-o", str(tmp_path / "o.jsonl"),
             str(tmp_path / "no-model")], e2e_env, timeout=60)
    assert r.returncode == 0 and (tmp_path / "o.jsonl").read_text() == "", r.stderr[-2000:]
    files = {"/in.jsonl": b"\n\n"}
    with _file_server(files) as url:  # both ends by URL: GET the input, PUT the output
        r = run([cli("pagedllm"), "run-batch", "-i", f"{url}/in.jsonl", "-o", f"{url}/out.jsonl"], e2e_env, timeout=60)
        assert r.returncode == 0 and files.get("/out.jsonl") == b"", r.stderr[-2000:]
        r = run([cli("pagedllm"), "run-batch", "-i", f"{url}/missing.jsonl", "-o", f"{url}/o.jsonl"], e2e_env,
                timeout=60)
        assert r.returncode == 1 and "404" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_lines_split_at_line_feeds_only() -> None:
    """A prompt holding U+2028 / U+0085 / a form feed raw (valid JSON) was cut there by str.splitlines: two lines
    of invalid JSON instead of one request."""
    from pagedllm.entrypoints.openai.run_batch import batch_lines

    prompts = ["a\u2028b", "c\x85d", "e\x0cf\x1cg"]
    text = "\r\n".join(json.dumps({"custom_id": str(i), "url": "/v1/completions", "body": {"prompt": p}},
                                  ensure_ascii=False) for i, p in enumerate(prompts)) + "\n"
    seen: set = set()
    parsed = [parse_line(line, seen) for line in batch_lines(text) if line.strip()]
    assert [request["body"]["prompt"] for _, request, error in parsed if error is None] == prompts


def test_parse_line_refusals() -> None:
    seen: set = set()
    ok = _line("a", "/v1/completions", {"prompt": "x"})
    assert parse_line(ok, seen)[1] == {"url": "/v1/completions", "body": {"prompt": "x"}}
    assert parse_line(ok, seen)[2]["error"]["message"] == "duplicate custom_id 'a'"
    assert "POST" in parse_line(json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/completions",
                                            "body": {}}), seen)[2]["error"]["message"]
    assert "custom_id" in parse_line(json.dumps({"url": "/v1/completions", "body": {}}), seen)[2]["error"]["message"]
    assert "body" in parse_line(json.dumps({"custom_id": "c", "url": "/v1/completions"}), seen)[2]["error"]["message"]
    assert "JSON object" in parse_line("[1, 2]", seen)[2]["error"]["message"]


def _vllm_is_shim() -> bool:
    try:
        import vllm
    except ImportError:
        return False
    return "vllm_compat" in (getattr(vllm, "__file__", "") or "")


@pytest.mark.skipif(not _vllm_is_shim(), reason="the pagedllm-vllm-compat shim is not installed")
def test_vllm_spellings_of_run_batch(e2e_env: dict, tmp_path) -> None:
    """vLLM users' two spellings: `vllm run-batch` and `python -m vllm.entrypoints.openai.run_batch`."""
    (tmp_path / "in.jsonl").write_text("\n")
    for command in ([cli("vllm"), "run-batch"], [sys.executable, "-m", "vllm.entrypoints.openai.run_batch"],
                    [sys.executable, "-m", "pagedllm.entrypoints.openai.run_batch"]):
        out = tmp_path / "out.jsonl"
        r = run([*command, "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--model", "M"], e2e_env, timeout=60)
        assert r.returncode == 0 and out.read_text() == "", (command, r.stderr[-2000:])
        out.unlink()
