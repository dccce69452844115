"""vLLM's server flags for HTTPS, a proxy's path prefix, CORS and the docs pages, through a real `pagedllm serve`:
--ssl-keyfile / --ssl-certfile (a self-signed certificate made with the openssl command), --root-path (the API key
is still checked on every /v1 route: uvicorn puts the prefix in front of the path), --allowed-origins and
--disable-fastapi-docs; bad SSL flags are one-line errors before any engine starts."""
from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import time

import httpx
import pytest

from robust_helpers import BIN, API_KEY, sse_events, stop

from pagedllm.entrypoints.server_process import free_port

ALLOWED = "https://chat.example.com"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command (.ci/run installs it)")
    d = tmp_path_factory.mktemp("tls")
    key, cert = str(d / "key.pem"), str(d / "cert.pem")
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


@pytest.fixture(scope="module")
def https_server(tiny_llama_dir: str, robust_env: dict, certificate, tmp_path_factory: pytest.TempPathFactory):
    key, cert_file = certificate
    cert = ssl.create_default_context(cafile=cert_file)  # the client's trust: this certificate alone
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("https-server") / "server.log")
    argv = [os.path.join(BIN, "pagedllm"), "serve", tiny_llama_dir, "--host", "127.0.0.1", "--port", str(port),
            "--api-key", API_KEY, "--kv-cache-memory-bytes", str(64 << 20), "--ssl-keyfile", key,
            "--ssl-certfile", cert_file, "--root-path", "/api", "--allowed-origins", json.dumps([ALLOWED]),
            "--disable-fastapi-docs"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=robust_env)
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # a hang guard
        while True:
            assert proc.poll() is None, open(log_path).read()[-3000:]
            try:
                if httpx.get(url + "/health", verify=cert, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the HTTPS server did not come up"
            time.sleep(0.5)
        yield url, cert, port, log_path
    finally:
        stop(proc)


def test_https_serves_completions_and_streams(https_server) -> None:
    url, cert, port, log_path = https_server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=url, verify=cert, headers=headers, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        with c.stream("POST", "/v1/completions",
                      json={"prompt": "hello", "max_tokens": 12, "ignore_eos": True, "stream": True}) as s:
            events = sse_events(s.iter_lines())
        assert events[-1] == "[DONE]" and len([e for e in events[:-1] if e["choices"]]) == 12
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port is no HTTP server
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).raise_for_status()
    with open(log_path) as f:
        assert f"at https://127.0.0.1:{port}/api/v1" in f.read()


def test_root_path_keeps_the_api_key_check(https_server) -> None:
    url, cert, _, _ = https_server
    with httpx.Client(base_url=url, verify=cert, timeout=60) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 401  # the hot route
        assert c.post("/v1/embeddings", json={"input": "x"}).status_code == 401
        ok = c.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200 and ok.json()["data"]
        assert c.get("/health").status_code == 200  # probes stay open


def test_cors_origins_and_docs_flags(https_server) -> None:
    url, cert, _, _ = https_server
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    with httpx.Client(base_url=url, verify=cert, timeout=60) as c:
        good = c.options("/v1/completions", headers={"Origin": ALLOWED, **preflight})
        assert good.status_code == 200 and good.headers["access-control-allow-origin"] == ALLOWED
        bad = c.options("/v1/completions", headers={"Origin": "https://elsewhere.example", **preflight})
        assert "access-control-allow-origin" not in bad.headers
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert c.get(path).status_code == 404, path


@pytest.mark.parametrize("flags, message", [
    (["--ssl-keyfile", "k.pem"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", "/nonexistent/k.pem", "--ssl-certfile", "/nonexistent/c.pem"], "cannot load --ssl-certfile"),
    (["--ssl-cert-reqs", "2"], "need HTTPS"),
    (["--allowed-origins", '{"origin": "*"}'], "--allowed-origins: must be a JSON list of strings"),
])
def test_bad_ssl_and_cors_flags_are_one_line_errors(flags, message, tiny_llama_dir, robust_env) -> None:
    r = subprocess.run([os.path.join(BIN, "pagedllm"), "serve", tiny_llama_dir, "--port", str(free_port()), *flags],
                       capture_output=True, text=True, env=robust_env, timeout=120)  # a hang guard
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_allowed_origins_take_json_or_a_plain_list() -> None:
    from pagedllm.entrypoints.openai.cli_args import _json_list, _root_path

    assert [_root_path(p) for p in ("api", "/api/", " /a/b ", "/")] == ["/api", "/api", "/a/b", ""]

    assert _json_list('["https://a.example", "https://b.example"]') == ["https://a.example", "https://b.example"]
    assert _json_list("*") == ["*"]
    assert _json_list("https://a.example, https://b.example") == ["https://a.example", "https://b.example"]
