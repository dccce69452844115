"""Sleep mode through a real server (vLLM's dev-mode routes): /sleep, /is_sleeping, /wake_up, /reset_prefix_cache
with VLLM_SERVER_DEV_MODE=1, behind --api-key, reaching both data-parallel engine cores from either of two API
processes; completions get 503 while asleep and the same tokens after; /metrics' vllm:engine_sleep_state follows
each core's state. (Without dev mode the routes are 404, and /ping
answers like /health: tests/e2e/test_http.py, on the shared server.)"""
from __future__ import annotations

import os

import httpx

from e2e_helpers import serving

KEY = "sleep-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FLAGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20), "--max-num-seqs", "4", "--seed", "0"]


def _env(dev_mode: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEDLLM_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE")}
    env.update(PAGEDLLM_DISABLE_PROGRESS_BARS="1", PYTHONUNBUFFERED="1")
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM's name works too
    return env


def complete(url: str) -> httpx.Response:
    # A fresh connection each time: with two API processes the kernel spreads connections over both.
    return httpx.post(url + "/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0, "ignore_eos": True})


def is_sleeping(url: str) -> bool:
    r = httpx.get(url + "/is_sleeping", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["is_sleeping"]


def post(url: str, path: str, **params) -> httpx.Response:
    return httpx.post(url + path, headers=AUTH, params=params, timeout=120)


def sleep_states(url: str) -> dict[str, str]:
    """vllm:engine_sleep_state from /metrics (a fresh connection: either API process): engine -> its state, the one
    label whose sample is 1 ("" when none is)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    states: dict[str, str] = {}
    for family in text_string_to_metric_families(r.text):
        if family.name == "vllm:engine_sleep_state":
            for sample in family.samples:
                engine, state = sample.labels["engine"], sample.labels["sleep_state"]
                assert sample.value in (0.0, 1.0) and sample.labels["model_name"]
                states.setdefault(engine, "")
                if sample.value == 1.0:
                    assert not states[engine], f"two states of engine {engine} are 1"
                    states[engine] = state
    return states


def all_in(url: str, state: str) -> bool:
    return sleep_states(url) == {"0": state, "1": state}


def test_sleep_and_wake_up_through_the_server(tiny_llama_dir, tmp_path):
    flags = FLAGS + ["--enable-sleep-mode", "--api-key", KEY, "--api-server-count", "2", "--data-parallel-size", "2"]
    with serving(tiny_llama_dir, flags, str(tmp_path / "server.log"), _env(dev_mode=True)) as url:
        for method in ("GET", "POST"):
            assert httpx.request(method, url + "/ping", timeout=30).status_code == 200  # no key: a health check
        assert httpx.post(url + "/sleep", timeout=30).status_code == 401  # these change the engine: keyed
        assert not is_sleeping(url) and all_in(url, "awake")
        first = complete(url)
        assert first.status_code == 200, first.text
        expected = first.json()["choices"][0]["text"]

        r = post(url, "/sleep", level="3")
        assert r.status_code == 400 and "level must be 1" in r.json()["error"]["message"]
        assert post(url, "/sleep", level="1").status_code == 200
        assert is_sleeping(url)
        # vLLM's vllm:engine_sleep_state, whichever API process answers the scrape: 1 on each core's state
        assert all(all_in(url, "weights_offloaded") for _ in range(3))
        for _ in range(4):  # whichever API process answers, whichever engine core it picks is asleep
            r = complete(url)
            assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"], r.text
        r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
        assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"], r.text  # not a started stream
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        r = post(url, "/wake_up", tags="optimizer")
        assert r.status_code == 400 and "tags must be among" in r.json()["error"]["message"]
        assert post(url, "/wake_up", tags="weights").status_code == 200
        assert is_sleeping(url) and complete(url).status_code == 503  # the KV cache is still asleep
        assert all_in(url, "")  # the weights are back (not offloaded), yet the engine does not serve (not awake)
        assert post(url, "/wake_up", tags="kv_cache").status_code == 200
        assert not is_sleeping(url) and all_in(url, "awake")
        assert complete(url).json()["choices"][0]["text"] == expected

        assert post(url, "/sleep", level="2").status_code == 200  # weights discarded, reloaded by wake_up
        assert all(all_in(url, "discard_all") for _ in range(3))
        assert post(url, "/wake_up").status_code == 200
        assert all(all_in(url, "awake") for _ in range(3))
        assert complete(url).json()["choices"][0]["text"] == expected
        assert post(url, "/reset_prefix_cache").status_code == 200
        refused_sleep_leaves_every_core_awake(url)


def refused_sleep_leaves_every_core_awake(url: str) -> None:
    """One core busy with a stream, the other idle: the idle one sleeps before the busy one refuses (409); the
    refused sleep must wake it again, else new requests routed to it get 503 until someone calls /wake_up."""
    body = {"prompt": [5, 6], "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True}
    for _ in range(3):  # (a stream that ends before the sleep arrives lets it succeed: try again)
        with httpx.stream("POST", url + "/v1/completions", headers=AUTH, json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # running now
            r = post(url, "/sleep", level="1")
            for _ in lines:
                pass
        if r.status_code == 409:
            break
        assert r.status_code == 200, r.text
        assert post(url, "/wake_up").status_code == 200
    assert r.status_code == 409 and "unfinished request" in r.json()["error"]["message"], r.text
    assert not is_sleeping(url)
    assert all(complete(url).status_code == 200 for _ in range(4))
