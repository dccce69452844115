"""`pagedllm serve --enable-lora`: adapters from --lora-modules (both forms) listed and routed by "model", run-time
load/unload behind VLLM_ALLOW_RUNTIME_LORA_UPDATING, every error with its status, an unload that lets running
requests finish, vllm:lora_requests_info, and the dashboard's per-adapter panel. Adapters are real PEFT adapters made on SmolLM2 here; each one's
greedy text equals transformers + PEFT's."""
from __future__ import annotations

import os
import subprocess
import threading

import httpx
import pytest

openai = pytest.importorskip("openai", reason="these tests call the server with the openai SDK")

from browser import dashboard_page  # noqa: E402
from e2e_helpers import (API_KEY, Server, api_server_counts, cli, dashboard_event, metric, stop,  # noqa: E402
                         wait_all_serving)

from pagedllm.entrypoints.server_process import free_port, wait_healthy  # noqa: E402
from tests.lora.lora_helpers import make_adapter, peft_greedy  # noqa: E402

PROMPT = "The best way to learn a language is"
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(smollm2_hf_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("server-loras")
    return {
        "sql": make_adapter(smollm2_hf_dir, str(d / "sql"), r=8, alpha=16, targets=ALL7, seed=11),
        "chat": make_adapter(smollm2_hf_dir, str(d / "chat"), r=4, alpha=8, targets=["q_proj", "v_proj"], seed=12,
                             use_rslora=True),
        "late": make_adapter(smollm2_hf_dir, str(d / "late"), r=16, alpha=16, targets=["o_proj", "down_proj"],
                             seed=13),
        "dora": make_adapter(smollm2_hf_dir, str(d / "dora"), r=4, alpha=8, targets=["q_proj"], seed=14,
                             use_dora=True),
        "big": make_adapter(smollm2_hf_dir, str(d / "big"), r=32, alpha=32, targets=["q_proj"], seed=15),
    }


@pytest.fixture(scope="module", params=api_server_counts(__file__), ids=lambda n: f"lora-api{n}")
def lora_server(request, smollm2_hf_dir, adapters, e2e_env, tmp_path_factory):
    """With 2 API processes too: each has its own name table, kept in step through the engine core."""
    tmp = tmp_path_factory.mktemp("lora-server")
    port = free_port()
    log_path = str(tmp / "server.log")
    env = dict(e2e_env, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    chat_json = '{"name": "chat", "path": "%s", "base_model_name": "smol"}' % adapters["chat"]
    cmd = [cli("pagedllm"), "serve", smollm2_hf_dir, "--port", str(port), "--api-key", API_KEY,
           "--served-model-name", "smol", "--dtype", "float32", "--max-model-len", "512",
           "--kv-cache-memory-bytes", str(128 << 20), "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
           "--lora-modules", f"sql={adapters['sql']}", chat_json, "--api-server-count", str(request.param)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path=log_path)
        server = Server(url, port, smollm2_hf_dir, proc, log_path, request.param)
        wait_all_serving(server)
        yield server
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_hf_dir).encode(PROMPT)


def expected_text(model_dir: str, adapter_dir, prompt_ids, n: int) -> str:
    from transformers import AutoTokenizer

    tokens = peft_greedy(model_dir, adapter_dir, list(prompt_ids), n)[0]
    return AutoTokenizer.from_pretrained(model_dir).decode(tokens, skip_special_tokens=True)


def complete(http: httpx.Client, model: str, prompt_ids, max_tokens: int = 6, **kw) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens,
                                              "temperature": 0, "ignore_eos": True, **kw})


def test_adapters_listed_and_routed(lora_server, adapters, prompt_ids, smollm2_hf_dir):
    client = openai.OpenAI(base_url=lora_server.base_url, api_key=API_KEY, max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["smol", "sql", "chat"]
    assert cards["sql"].parent == "smol" and cards["sql"].root == adapters["sql"]
    assert cards["chat"].parent == "smol" and cards["smol"].parent is None
    texts = {}
    with lora_server.client() as http:
        for model, adapter in (("smol", None), ("sql", adapters["sql"]), ("chat", adapters["chat"])):
            r = complete(http, model, prompt_ids)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            texts[model] = r.json()["choices"][0]["text"]
            assert texts[model] == expected_text(smollm2_hf_dir, adapter, prompt_ids, 6), model
    assert len(set(texts.values())) == 3  # each adapter changes the output
    # chat + streaming + n per adapter
    stream = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, temperature=0, n=2, stream=True)
    pieces = {0: "", 1: ""}
    for chunk in stream:
        assert chunk.model == "sql"
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
    assert pieces[0] == pieces[1] and pieces[0]


def test_beam_search_runs_under_the_adapter(lora_server, adapters, prompt_ids, smollm2_hf_dir):
    """A beam of width 1 is the greedy answer: under "model": "sql" it must be the adapter's, not the base's (beam
    steps used to run on the base model)."""
    with lora_server.client() as http:
        for model, adapter in (("sql", adapters["sql"]), ("smol", None)):
            r = complete(http, model, prompt_ids, use_beam_search=True, n=1)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected_text(smollm2_hf_dir, adapter, prompt_ids, 6), model


def test_runtime_load_unload_and_errors(lora_server, adapters, prompt_ids, smollm2_hf_dir, tmp_path):
    with lora_server.client() as http:
        assert complete(http, "late", prompt_ids).status_code == 404
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]})
        assert r.status_code == 200 and "late" in r.text
        assert "late" in [m["id"] for m in http.get("/v1/models").json()["data"]]
        r = complete(http, "late", prompt_ids)
        assert r.json()["choices"][0]["text"] == expected_text(smollm2_hf_dir, adapters["late"], prompt_ids, 6)
        # vLLM's load_inplace reloads a loaded name (was ignored: "already been loaded"); then back to its own path
        for path in (adapters["sql"], adapters["late"]):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path, "load_inplace": True})
            assert r.status_code == 200, r.text
            if path == adapters["sql"]:
                r = complete(http, "late", prompt_ids)
                assert r.json()["choices"][0]["text"] == expected_text(smollm2_hf_dir, path, prompt_ids, 6)
        errors = [
            ({"lora_name": "late", "lora_path": adapters["late"]}, 400, "already been loaded"),
            ({"lora_name": "smol", "lora_path": adapters["late"]}, 400, "already been loaded"),
            ({"lora_name": "nope", "lora_path": str(tmp_path / "missing")}, 400, "not a directory"),
            ({"lora_name": "dora", "lora_path": adapters["dora"]}, 400, "DoRA"),
            ({"lora_name": "big", "lora_path": adapters["big"]}, 400, "max_lora_rank"),
            ({"lora_name": "x"}, 400, "lora_path"),
        ]
        for body, status, words in errors:
            r = http.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["smol", "sql", "chat", "late"]
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "ghost"})
        assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json={"model": "ghost", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_unload_lets_running_requests_finish(lora_server, adapters, prompt_ids):
    with lora_server.client() as http:
        if "late" not in [m["id"] for m in http.get("/v1/models").json()["data"]]:
            http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]})
        started = threading.Event()
        result: dict = {}

        def run() -> None:
            with lora_server.client() as h2, h2.stream("POST", "/v1/completions", json={
                    "model": "late", "prompt": list(prompt_ids), "max_tokens": 32, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as r:
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
                    if line:
                        lines.append(line)
                result["status"], result["lines"] = r.status_code, lines

        t = threading.Thread(target=run)
        t.start()
        assert started.wait(120)
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert r.status_code == 200, r.text
        assert t.is_alive()  # the stream was still running when its adapter was unloaded
        assert complete(http, "late", prompt_ids).status_code == 404  # gone for new requests at once
        t.join(300)
        assert result["status"] == 200 and result["lines"][-1] == "data: [DONE]"
        assert any('"finish_reason":"length"' in line for line in result["lines"])
        assert sum(1 for line in result["lines"] if '"text":' in line) >= 30  # (+ a possible empty final chunk)
        # the adapter can be loaded again under the same name
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]})
        assert r.status_code == 200


def test_a_run_time_load_routes_on_every_api_process(lora_server, adapters, prompt_ids, smollm2_hf_dir):
    """Loaded through one connection (one API process), the name routes on every connection at once (each of
    these on its own, so with 2 API processes both take some), and an unload is as quick."""
    def fresh(model: str) -> httpx.Response:
        with httpx.Client(base_url=lora_server.url, timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}", "Connection": "close"}) as h:
            return complete(h, model, prompt_ids, max_tokens=3)

    before = {}
    with lora_server.client() as http:
        before = {p: metric(http.get("/metrics").text, "pagedllm:api_server_requests_total", api_server=p)
                  for p in map(str, range(lora_server.api_servers))}
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "late-again", "lora_path": adapters["late"]})
        assert r.status_code == 200, r.text
    want = expected_text(smollm2_hf_dir, adapters["late"], prompt_ids, 3)
    texts = [fresh("late-again").json()["choices"][0]["text"] for _ in range(24)]
    assert texts == [want] * 24
    with lora_server.client() as http:
        text = http.get("/metrics").text
        taken = [metric(text, "pagedllm:api_server_requests_total", api_server=p) - before[p] for p in before]
        assert min(taken) >= 1, taken  # every API process served the adapter
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "late-again"})
        assert r.status_code == 200, r.text
    assert [fresh("late-again").status_code for _ in range(8)] == [404] * 8


def test_lora_requests_info_metric(lora_server, prompt_ids):
    with lora_server.client() as http:
        assert complete(http, "sql", prompt_ids, max_tokens=2).status_code == 200
        text = http.get("/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0], lines
    assert metric(text, "vllm:lora_requests_info", max_lora="2") > 1e9  # a timestamp


def test_runtime_routes_off_without_the_variable_and_lora_off(http):
    """The session's plain server (no --enable-lora, no variable): the routes say how to turn them on."""
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
    assert r.status_code == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404


def test_dashboard_lora_panel(lora_server, prompt_ids):
    """The dashboard's LoRA panel: every adapter /v1/models lists, with its path; requests on one counted as running
    on that adapter while they run (the engine core's per-adapter counts), the base model apart; nothing once done;
    and the page in Chromium draws those rows."""
    with lora_server.client() as http:
        cards = {m["id"]: m for m in http.get("/v1/models").json()["data"] if m["parent"] is not None}
        seen = threading.Event()
        statuses: list[int] = []

        def load() -> None:  # "sql" requests until the dashboard has shown one running (at most 20)
            with lora_server.client() as h2:
                for _ in range(20):
                    statuses.append(complete(h2, "sql", prompt_ids, max_tokens=32).status_code)
                    if seen.is_set():
                        return

        t = threading.Thread(target=load)
        t.start()
        try:
            busy = dashboard_event(http, lambda e: any(a["name"] == "sql" and a["running"] == 1
                                                       for a in e["lora"]["adapters"]), "a request running on sql")
        finally:
            seen.set()
            t.join(300)
        assert statuses and set(statuses) == {200}
        lora = busy["lora"]
        assert lora["max_loras"] == 2 and lora["active"] == 1 and lora["base_running"] == 0
        assert {a["name"]: a["path"] for a in lora["adapters"]} == {name: c["root"] for name, c in cards.items()}
        ids = [a["id"] for a in lora["adapters"]]
        assert ids == sorted(set(ids)) and ids[0] >= 1  # 0 is the base model
        assert all(a["running"] == 0 for a in lora["adapters"] if a["name"] != "sql")
        idle = dashboard_event(http, lambda e: e["requests"]["running"] + e["requests"]["waiting"] == 0,
                               "no request left")
        assert all(a["running"] == a["waiting"] == 0 for a in idle["lora"]["adapters"])
    # the page draws the panel: a row for the base model, then one per adapter in id order
    with dashboard_page(lora_server.url, API_KEY) as page:
        page.wait_for_selector("#lora-table:not(.hidden) tbody tr")
        rows = page.locator("#lora-table tbody tr th").all_inner_texts()
        assert rows == ["(base model)"] + [a["name"] for a in idle["lora"]["adapters"]]
        assert page.locator("#lora-off").is_hidden() and page.locator("#spec-off").is_visible()
