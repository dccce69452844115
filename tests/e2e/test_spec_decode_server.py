"""`pagedllm serve --speculative-config JSON`: a bad config stops the start with its message; a good one serves,
/metrics counts drafts and accepted tokens under vLLM's names, and the dashboard's speculative-decoding panel shows
the same counts (in its events and, drawn, in Chromium); a response_format json_schema request on it is answered
under its schema."""
from __future__ import annotations

import json
import subprocess

import httpx
import openai
import pytest

from browser import dashboard_page
from e2e_helpers import cli, dashboard_event, metric, stop

from pagedllm.entrypoints.server_process import free_port, wait_healthy


def test_bad_speculative_config_fails_at_start(smollm2_hf_dir, e2e_env):
    for bad, message in [('{"method": "ngram", "num_speculative_tokens": 0}', ">= 1"),
                         ('{"method": "medusa", "num_speculative_tokens": 2}', "not supported yet"),
                         ("{oops", "JSON")]:
        proc = subprocess.run([cli("pagedllm"), "serve", smollm2_hf_dir, "--port", str(free_port()),
                               "--speculative-config", bad], env=e2e_env, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        assert message in proc.stdout + proc.stderr


def test_ngram_server_counts_drafts(smollm2_hf_dir, e2e_env, tmp_path):
    port = free_port()
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    log_path = str(tmp_path / "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([cli("pagedllm"), "serve", smollm2_hf_dir, "--port", str(port), "--max-model-len",
                                 "512", "--kv-cache-memory-bytes", str(64 << 20), "--speculative-config", spec],
                                stdout=log, stderr=subprocess.STDOUT, env=e2e_env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path=log_path)
        # structured outputs on the speculating server: the answer follows the schema
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["name", "age"]}
        record = '{"name": "fox", "age": 7}'
        chat = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model=smollm2_hf_dir, temperature=0, max_tokens=40,
            messages=[{"role": "user", "content": f"Repeat this JSON exactly: {record}"}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
        answer = json.loads(chat.choices[0].message.content)
        assert set(answer) == {"name", "age"} and chat.choices[0].finish_reason == "stop"
        text = "one two three four five six seven eight nine ten " * 3
        r = httpx.post(url + "/v1/completions", json={"prompt": "Repeat: " + text + "\nRepeat: one two three",
                                                      "max_tokens": 24, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        m = httpx.get(url + "/metrics", timeout=30).text
        drafted = metric(m, "vllm:spec_decode_num_draft_tokens_total")
        accepted = metric(m, "vllm:spec_decode_num_accepted_tokens_total")
        assert metric(m, "vllm:spec_decode_num_drafts_total") > 0 and drafted > 0 and 0 < accepted <= drafted
        pos0 = metric(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0")
        assert pos0 > 0
        drafts = metric(m, "vllm:spec_decode_num_drafts_total")
        # the dashboard's panel: the same counters (both come from the engine's stats), once it has the last stats
        with httpx.Client(base_url=url) as http:
            event = dashboard_event(http, lambda e: e["spec_decode"] is not None
                                    and e["spec_decode"]["drafts_total"] == drafts, f"{drafts} drafts")
        spec = event["spec_decode"]
        assert event["model"]["speculative"] == "ngram x4"
        assert (spec["draft_tokens_total"], spec["accepted_tokens_total"]) == (drafted, accepted)
        assert spec["acceptance_rate_total"] == pytest.approx(accepted / drafted)
        assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
        assert len(spec["per_position"]) == 4 and spec["per_position"][0] == pytest.approx(pos0 / drafts, abs=1e-4)
        assert spec["per_position"] == sorted(spec["per_position"], reverse=True)  # a later position needs the earlier
        assert 0 < spec["acceptance_rate"] <= 1  # the last minute holds this request's drafts
        with dashboard_page(url) as page:  # the page in Chromium draws the panel
            page.wait_for_selector("#spec-on:not(.hidden)")
            assert page.inner_text("#spec-drafted") == f"{int(drafted):,}" and page.locator("#spec-off").is_hidden()
            assert page.locator("#spec-positions .pos").count() == 4 and page.locator("#lora-off").is_visible()
    finally:
        stop(proc)
