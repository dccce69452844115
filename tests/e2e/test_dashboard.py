"""GET /dashboard on the session's real `pagedllm serve` (SmolLM2 on the CPU, with an API key): the event stream's
JSON schema, event by event, and its numbers against /metrics and the requests sent; the key (header, form, cookie);
and the page itself in a real browser (Debian's Chromium driven by Playwright) while requests run.
--no-dashboard is tested on test_server_flags.py's server. Assertions are on counts and order; timeouts are only
hang guards."""
from __future__ import annotations

import base64
import json
import os
import struct
import threading
import time
import zlib
from typing import Callable, Optional

import httpx
import jsonschema
import pytest

from browser import chromium
from e2e_helpers import API_KEY, MAX_MODEL_LEN, SERVED_NAME, Server, metric

HANG_GUARD_S = 120
ARTIFACTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".cache",
                         "test-artifacts")

_num = {"type": "number", "minimum": 0}
_int = {"type": "integer", "minimum": 0}
_rate = {"type": ["number", "null"], "minimum": 0, "maximum": 1}
_latency = {"type": "object", "required": ["count", "p50", "p90", "p99"], "additionalProperties": False,
            "properties": {"count": _int, **{q: {"type": ["number", "null"], "minimum": 0} for q in ("p50", "p90",
                                                                                                   "p99")}}}
_point = {"type": "object", "required": ["t", "running", "waiting", "preempted", "prompt_tps", "gen_tps", "kv_usage"],
          "additionalProperties": False,
          "properties": {"t": _num, "running": _int, "waiting": _int, "preempted": _int, "prompt_tps": _num,
                         "gen_tps": _num, "kv_usage": {"type": "number", "minimum": 0, "maximum": 1}}}
_counts = {"free": _int, "cached": _int, "used": _int, "shared": _int}
EVENT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["seq", "time", "uptime_s", "status", "status_detail", "clients", "model", "kv", "requests",
                 "throughput", "latency", "prefix_cache", "spec_decode", "lora", "point"],
    "additionalProperties": False,
    "properties": {
        "seq": {"type": "integer", "minimum": 1},
        "time": _num, "uptime_s": _num,
        "status": {"enum": ["ok", "engine_dead", "draining"]},
        "status_detail": {"type": "string"},
        "clients": {"type": "integer", "minimum": 1},
        "model": {"type": "object",
                  "required": ["name", "served_names", "model_dir", "max_model_len", "data_parallel_size", "api_pid",
                               "device", "dtype", "kv_cache_dtype", "block_size", "num_blocks", "max_num_seqs",
                               "tensor_parallel_size", "pipeline_parallel_size", "engine_pid", "pagedllm", "torch",
                               "transformers", "python"],
                  "properties": {"name": {"type": "string"}, "served_names": {"type": "array",
                                                                              "items": {"type": "string"}},
                                 "max_model_len": {"type": "integer", "minimum": 1},
                                 "block_size": {"type": "integer", "minimum": 1},
                                 "num_blocks": {"type": "integer", "minimum": 1}},
                  "additionalProperties": {"type": ["string", "integer"]}},
        "kv": {"type": "object", "additionalProperties": False,
               "required": ["block_size", "num_blocks", "free", "cached", "used", "shared", "usage", "tokens_capacity",
                            "tokens_free", "pools"],
               "properties": {"block_size": {"type": "integer", "minimum": 1}, "num_blocks": _int, **_counts,
                              "usage": {"type": "number", "minimum": 0, "maximum": 1}, "tokens_capacity": _int,
                              "tokens_free": _int,
                              "pools": {"type": "array", "minItems": 1, "items": {
                                  "type": "object", "additionalProperties": False,
                                  "required": ["engine", "num_blocks", "blocks_per_cell", "cells", "stale", "free",
                                               "cached", "used", "shared"],
                                  "properties": {"engine": _int, "num_blocks": _int,
                                                 "blocks_per_cell": {"type": "integer", "minimum": 1},
                                                 "cells": {"type": "string", "contentEncoding": "base64"},
                                                 "stale": {"type": "boolean"}, **_counts}}}}},
        "requests": {"type": "object", "additionalProperties": False,
                     "required": ["running", "waiting", "preempted", "preemptions_total", "preemptions_per_s",
                                  "finished_total"],
                     "properties": {"running": _int, "waiting": _int, "preempted": _int, "preemptions_total": _int,
                                    "preemptions_per_s": _num, "finished_total": _int}},
        "throughput": {"type": "object", "additionalProperties": False,
                       "required": ["prompt_tokens_per_s", "generation_tokens_per_s", "prompt_tokens_total",
                                    "generation_tokens_total"],
                       "properties": {"prompt_tokens_per_s": _num, "generation_tokens_per_s": _num,
                                      "prompt_tokens_total": _int, "generation_tokens_total": _int}},
        "latency": {"type": "object", "additionalProperties": False, "required": ["window_s", "ttft", "tpot", "e2e"],
                    "properties": {"window_s": _num, "ttft": _latency, "tpot": _latency, "e2e": _latency}},
        "prefix_cache": {"type": "object", "additionalProperties": False,
                         "required": ["hit_rate", "hit_rate_total", "queried_tokens_total", "hit_tokens_total"],
                         "properties": {"hit_rate": _rate, "hit_rate_total": _rate, "queried_tokens_total": _int,
                                        "hit_tokens_total": _int}},
        "spec_decode": {"type": ["object", "null"]},
        "lora": {"type": ["object", "null"]},
        "point": _point,
        "history": {"type": "array", "items": _point, "minItems": 1},
    },
}


class EventReader:
    """One /dashboard/events stream read in a thread: every event is validated against EVENT_SCHEMA as it comes."""

    def __init__(self, url: str, headers: dict) -> None:
        self.events: list[dict] = []
        self.error: Optional[BaseException] = None
        self.stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(url, headers), daemon=True)
        self._thread.start()

    def _run(self, url: str, headers: dict) -> None:
        try:
            with httpx.stream("GET", url + "/dashboard/events", headers=headers, timeout=HANG_GUARD_S) as r:
                assert r.status_code == 200, r.status_code
                assert r.headers["content-type"].startswith("text/event-stream")
                assert r.headers["x-accel-buffering"] == "no" and r.headers["cache-control"] == "no-cache"
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[len("data: "):])
                    jsonschema.validate(event, EVENT_SCHEMA)
                    with self._cond:
                        self.events.append(event)
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported by wait_for / close
            self.error = e
            with self._cond:
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[dict], bool], what: str) -> dict:
        deadline = time.monotonic() + HANG_GUARD_S
        seen = 0
        with self._cond:
            while True:
                for event in self.events[seen:]:
                    if predicate(event):
                        return event
                seen = len(self.events)
                if self.error is not None:
                    raise AssertionError(f"the event stream failed: {self.error!r}")
                assert time.monotonic() < deadline, f"no event with {what} (hang guard)"
                self._cond.wait(1.0)

    def close(self) -> list[dict]:
        self.stop.set()
        self._thread.join(HANG_GUARD_S)
        if self.error is not None:
            raise self.error
        return self.events


def cells_of(pool: dict) -> bytes:
    return base64.b64decode(pool["cells"])


def generation_tokens_total(http: httpx.Client) -> int:
    return int(metric(http.get("/metrics").text, "vllm:generation_tokens_total"))


def test_events_follow_the_schema_and_the_engine(server: Server, http: httpx.Client) -> None:
    """Every event matches the schema; the first carries the history; KV counts add up to the pool and match its
    grid; running requests show in the requests, blocks in use and tokens; once they are done the totals equal
    /metrics' and what the requests got, and their blocks are free or cached again."""
    reader = EventReader(server.url, {"Authorization": f"Bearer {API_KEY}"})
    try:
        first = reader.wait_for(lambda e: True, "anything")
        assert first["history"] and first["history"][-1] == first["point"]
        model = first["model"]
        assert model["name"] == SERVED_NAME and model["served_names"] == [SERVED_NAME, "smol-alias"]
        assert model["max_model_len"] == MAX_MODEL_LEN and model["block_size"] == 16 and model["device"] == "cpu"
        if server.api_servers == 1:
            assert model["api_pid"] == server.proc.pid
        else:  # the API server process that answered: one of the supervisor's children
            with open(f"/proc/{model['api_pid']}/stat") as f:
                assert int(f.read().rsplit(") ", 1)[1].split()[1]) == server.proc.pid
        assert model["tensor_parallel_size"] == 1
        assert first["kv"]["num_blocks"] == model["num_blocks"]
        assert first["status"] == "ok" and first["spec_decode"] is None and first["lora"] is None
        tokens_before = first["throughput"]["generation_tokens_total"]
        finished_before = first["requests"]["finished_total"]

        max_tokens = 48
        results: list[int] = []
        busy_seen = threading.Event()

        def load(i: int) -> None:
            # until the stream has shown a running request (at most 20 requests per thread)
            for k in range(20):
                if busy_seen.is_set() and k > 0:
                    return
                body = {"prompt": f"Request {i}.{k} of the dashboard test tells a story:", "max_tokens": max_tokens,
                        "ignore_eos": True}
                results.append(http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"])

        threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        try:
            busy = reader.wait_for(lambda e: e["requests"]["running"] >= 1
                                   and e["kv"]["used"] + e["kv"]["shared"] >= 1, "a running request")
        finally:
            busy_seen.set()
            for t in threads:
                t.join(HANG_GUARD_S)
        n = len(results)
        assert n >= 4 and results == [max_tokens] * n
        expected = generation_tokens_total(http)
        assert expected >= tokens_before + n * max_tokens
        done = reader.wait_for(lambda e: e["throughput"]["generation_tokens_total"] == expected
                               and e["requests"]["running"] == 0, "the finished requests' tokens")
        assert done["requests"]["finished_total"] >= finished_before + n
        assert done["latency"]["e2e"]["count"] >= n and done["latency"]["ttft"]["count"] >= n
        assert done["latency"]["e2e"]["p50"] > 0 and done["latency"]["tpot"]["p99"] > 0
        assert done["prefix_cache"]["queried_tokens_total"] > 0
    finally:
        events = reader.close()
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs)), "events in order, none twice"
    assert all("history" not in e for e in events[1:])
    for e in events:
        kv = e["kv"]
        pool = kv["pools"][0]
        assert pool["blocks_per_cell"] == 1 and not pool["stale"]  # this pool is small: one cell per block
        grid = cells_of(pool)
        assert len(grid) == kv["num_blocks"] == pool["num_blocks"]
        assert [grid.count(s) for s in range(4)] == [kv["free"], kv["cached"], kv["used"], kv["shared"]]
        assert kv["usage"] == pytest.approx((kv["used"] + kv["shared"]) / kv["num_blocks"], abs=1e-4)
        assert kv["tokens_free"] == (kv["free"] + kv["cached"]) * kv["block_size"]
        assert kv["tokens_capacity"] == kv["num_blocks"] * kv["block_size"]
    assert busy["point"]["running"] == busy["requests"]["running"]
    # after the requests: nothing in use (this test's requests are the server's only ones); their full blocks cached
    assert done["kv"]["used"] + done["kv"]["shared"] == 0 and done["kv"]["cached"] > 0


def test_dashboard_needs_the_key(server: Server) -> None:
    """Without the key: 401 for the page (a key form for browsers) and the events; the key as a Bearer header or
    through the form's cookie (derived from the key, HttpOnly, SameSite=Strict) opens both; the assets hold no data
    and are open; nothing echoes the key."""
    url = server.url
    with httpx.Client(base_url=url, timeout=60) as c:
        for path in ("/dashboard", "/dashboard/events"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                            {"Cookie": "pagedllm_dashboard=" + API_KEY}, {"Cookie": "pagedllm_dashboard=x"}):
                r = c.get(path, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["type"] == "authentication_error" and API_KEY not in r.text
        form = c.get("/dashboard", headers={"Accept": "text/html"})
        assert form.status_code == 401 and 'id="api-key"' in form.text and "text/html" in form.headers["content-type"]
        page = c.get("/dashboard", headers={"Authorization": f"Bearer {API_KEY}"})
        assert page.status_code == 200 and 'id="kv-grid"' in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert "<script>" not in page.text and "http://" not in page.text and "https://" not in page.text  # no CDN
        for name in ("dashboard.js", "dashboard.css", "login.js"):
            asset = c.get(f"/dashboard/assets/{name}")
            assert asset.status_code == 200 and len(asset.content) > 100
        for name in ("nope.js", "..%2Fapp.py", "../routes.py", "engine_side.py"):
            assert c.get(f"/dashboard/assets/{name}").status_code == 404, name
        wrong = c.post("/dashboard/login", json={"api_key": "wrong"})
        assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
        assert c.post("/dashboard/login", json={"key": API_KEY}).status_code == 400
        assert c.post("/dashboard/login", content=b"api_key=x",
                      headers={"content-type": "application/x-www-form-urlencoded"}).status_code == 415
        ok = c.post("/dashboard/login", json={"api_key": API_KEY})
        assert ok.status_code == 204
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        assert API_KEY not in cookie and c.cookies.get("pagedllm_dashboard")
        assert c.get("/dashboard").status_code == 200  # the client sends the cookie now
        with c.stream("GET", "/dashboard/events") as r:
            assert r.status_code == 200
            line = next(x for x in r.iter_lines() if x.startswith("data: "))
            jsonschema.validate(json.loads(line[len("data: "):]), EVENT_SCHEMA)
        assert c.get("/v1/models").status_code == 401  # the cookie is the dashboard's, not the API's
    assert API_KEY not in server.log()
    assert f"Dashboard: {url}/dashboard" in server.log()  # named at start (test_server_flags: not with --no-dashboard)


# ---- the page in a real browser ------------------------------------------------------------------------------------


def png_size_and_colors(data: bytes) -> tuple[int, int, int]:
    """(width, height, distinct byte values of the pixel data) of a PNG, by the stdlib alone."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", (0, 0)
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            size = struct.unpack(">II", chunk[:8])
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    return size[0], size[1], len(set(zlib.decompress(idat)))


def test_page_in_chromium_shows_the_engine_live(server: Server, http: httpx.Client) -> None:
    """Log in through the key form, then while requests run the grid shows blocks in use and the numbers move;
    after them the grid's blocks are free or cached and the generated-token total is /metrics' own. No console
    errors. The screenshot is kept in .cache/test-artifacts/dashboard.png."""
    stop_load = threading.Event()
    sent: list[int] = []

    def load(i: int) -> None:
        # until the page has shown the load (bounded: at most 40 requests per thread)
        for k in range(40):
            if stop_load.is_set():
                return
            r = http.post("/v1/completions", json={"prompt": f"Thread {i} request {k}: once upon a time",
                                                   "max_tokens": 32, "ignore_eos": True})
            sent.append(r.status_code)

    problems: list[str] = []
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url + "/dashboard")
        assert page.locator("#api-key").count() == 1  # the key form (the page answered 401)
        page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.fill("#api-key", API_KEY)
        page.click("button[type=submit]")
        page.wait_for_selector("#kv-grid[data-cells]", timeout=HANG_GUARD_S * 1000)

        def attr(selector: str, name: str) -> int:
            return int(page.get_attribute(selector, name) or 0)

        def wait_until(check: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + HANG_GUARD_S
            while not check():
                assert time.monotonic() < deadline, f"the page never showed {what}"
                page.wait_for_timeout(100)

        cells = attr("#kv-grid", "data-cells")
        assert cells == int(page.inner_text("#kv-used").split("/")[1].replace(",", ""))
        gen_before = page.inner_text("#tp-gen-total")
        updates_before = attr("body", "data-updates")
        threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: attr("#kv-grid", "data-used") > 0 and int(page.inner_text("#req-running")) > 0,
                       "blocks in use and running requests")
            busy_shot = page.locator("#kv-grid").screenshot()
            page.screenshot(path=_artifact("dashboard.png"), full_page=True)
        finally:
            stop_load.set()
            for t in threads:
                t.join(HANG_GUARD_S)
        assert sent and set(sent) == {200}
        expected = f"{generation_tokens_total(http):,}"
        wait_until(lambda: page.inner_text("#tp-gen-total") == expected and attr("#kv-grid", "data-used") == 0,
                   f"{expected} generated tokens and no block in use")
        assert page.inner_text("#tp-gen-total") != gen_before
        assert attr("body", "data-updates") > updates_before
        assert attr("#kv-grid", "data-cached") > 0  # the finished requests' prefixes stay cached
        assert page.locator("#kv-grid").screenshot() != busy_shot  # the grid was redrawn
        assert page.text_content("#status") == "running"
        assert page.inner_text("#model-name") == SERVED_NAME
        assert page.inner_text("#ttft-p50") not in ("", "\u2013")
        assert page.locator("#lora-off").is_visible() and page.locator("#spec-off").is_visible()
    assert not problems, problems
    width, height, colors = png_size_and_colors(open(_artifact("dashboard.png"), "rb").read())
    assert width == 1400 and height >= 1000 and colors > 16  # a page, not a blank


def _artifact(name: str) -> str:
    os.makedirs(ARTIFACTS, exist_ok=True)
    return os.path.join(ARTIFACTS, name)

