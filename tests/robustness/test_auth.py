"""--api-key: every /v1/* route of the served OpenAPI schema (so routes added later are covered too) needs
`Authorization: Bearer KEY`; no response echoes the key; /health, /metrics, /version stay open."""
from __future__ import annotations

import httpx
import pytest

from robust_helpers import API_KEY

WRONG = [None, "Bearer wrong", f"Bearer {API_KEY}x", f"Bearer {API_KEY[:-1]}", f"bearer {API_KEY}", API_KEY,
         f"Basic {API_KEY}", f"Bearer  {API_KEY}"]


def _v1_operations(server) -> list[tuple[str, str]]:
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    ops = [(method.upper(), path) for path, item in schema["paths"].items() for method in item
           if path.startswith("/v1/")]
    assert ("POST", "/v1/chat/completions") in ops and ("GET", "/v1/models") in ops
    return ops


def test_every_v1_route_needs_the_key(tiny_server) -> None:
    with httpx.Client(base_url=tiny_server.url, timeout=30) as client:
        for method, path in _v1_operations(tiny_server):
            for auth in WRONG:
                headers = {"Authorization": auth} if auth else {}
                r = client.request(method, path, headers=headers, json={"prompt": "hi", "max_tokens": 1})
                assert r.status_code == 401, (method, path, auth, r.status_code)
                assert r.json()["error"]["type"] == "authentication_error"
                assert API_KEY not in r.text and "wrong" not in r.text
            ok = client.request(method, path, headers={"Authorization": f"Bearer {API_KEY}"},
                                json={"prompt": "hi", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
            assert ok.status_code != 401 and API_KEY not in ok.text, (method, path)


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_probes_stay_open(tiny_server, path: str) -> None:
    r = httpx.get(tiny_server.url + path, timeout=30)
    assert r.status_code == 200 and API_KEY not in r.text


def test_key_is_not_in_the_schema_or_logs(tiny_server) -> None:
    assert API_KEY not in httpx.get(tiny_server.url + "/openapi.json", timeout=30).text
    assert API_KEY not in tiny_server.log()


def test_vllm_api_key_variable_guards_the_server(tiny_llama_dir: str, robust_env: dict, tmp_path) -> None:
    """vLLM's `VLLM_API_KEY` (the key `vllm serve` takes without --api-key, from a secret) guards the server as
    PAGEDLLM_API_KEY does: it was ignored, so a deployment moved from vLLM served every route without a key.
    --api-key wins over it."""
    from robust_helpers import launch, stop

    env = dict(robust_env, VLLM_API_KEY="from-vllm-env")
    server = launch(tiny_llama_dir, ["--served-model-name", "tiny"], env, str(tmp_path / "env.log"))
    try:
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
        ok = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer from-vllm-env"}, timeout=30)
        assert ok.status_code == 200, ok.text
    finally:
        stop(server.proc)
    server = launch(tiny_llama_dir, ["--served-model-name", "tiny", "--api-key", "flag"], env,
                    str(tmp_path / "flag.log"))
    try:
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer flag"},
                         timeout=30).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer from-vllm-env"},
                         timeout=30).status_code == 401
    finally:
        stop(server.proc)
