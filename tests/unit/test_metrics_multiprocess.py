"""/metrics with several API server processes: each process records into prometheus_client's multiprocess
directory, and whichever renders shows the sums, under the same names, types and labels as one process does;
the engine's gauges and totals come from the renderer's latest SchedulerStats, never summed over processes.
Each process is a fresh interpreter (prometheus_client takes PROMETHEUS_MULTIPROC_DIR at import)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_RECORD = r'''
import json, sys
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.metrics import Metrics
mode, directory, index, requests = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
m = Metrics("m", num_engines=2, multiprocess_dir=directory if mode == "multi" else None, api_server=index)
for engine in (0, 1):
    m.engine_ready(engine, 1024, {"block_size": "16", "num_gpu_blocks": str(90 + engine)})
for i in range(requests):
    engine = i % 2
    m.api_server_requests.inc()
    m.observe_first_token(0.05, 10, engine)
    m.add_generation_tokens(7, engine)
    m.observe_gaps([0.02, 0.3, 0.02, 100.0], engine)
    m.observe_iteration_tokens(17, engine)
    m.observe_finished("length" if i % 3 else "abort", 0.9, 0.01, engine, max_tokens=7,
                       samples=(2, 7) if i % 2 else None)
m.update_scheduler_stats(SchedulerStats(3, 1, 0.25, 100, 40, 2, num_aborted=5), None, 0)
if mode != "record":
    from prometheus_client.parser import text_string_to_metric_families
    families = {f.name: (f.type, sorted((s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples))
                for f in text_string_to_metric_families(m.render().decode())}
    print("RESULT " + json.dumps(families))
'''


def _run(mode: str, directory: str, index: int, requests: int) -> dict:
    path = os.pathsep.join([os.path.join(REPO_ROOT, "src"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    if mode != "single":
        env["PROMETHEUS_MULTIPROC_DIR"] = directory
    out = subprocess.run([sys.executable, "-c", _RECORD, mode, directory, str(index), str(requests)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(lines[0][len("RESULT "):]) if lines else {}


def _value(families: dict, family: str, sample: str, **labels: str) -> float:
    return sum(v for name, lbls, v in families[family][1] if name == sample and labels.items() <= dict(lbls).items())


def test_two_processes_add_up_under_the_names_of_one(tmp_path) -> None:
    directory = str(tmp_path / "mp")
    os.makedirs(directory)
    _run("record", directory, 0, 6)  # API process 0: 6 requests
    merged = _run("multi", directory, 1, 9)  # API process 1: 9 requests, and renders
    single = _run("single", str(tmp_path), 0, 15)  # one process, all 15
    assert {k: v[0] for k, v in merged.items()} == {k: v[0] for k, v in single.items()}  # same families, types
    for family, sample, labels in (
            ("vllm:request_success", "vllm:request_success_total", {"finished_reason": "abort"}),
            ("vllm:request_success", "vllm:request_success_total", {"finished_reason": "length", "engine": "1"}),
            ("vllm:generation_tokens", "vllm:generation_tokens_total", {}),
            ("vllm:prompt_tokens", "vllm:prompt_tokens_total", {"engine": "0"}),
            ("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count", {}),
            ("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_bucket", {"le": "0.06"}),
            ("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_bucket", {"le": "0.025"}),
            ("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count", {"engine": "1"}),
            ("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_bucket", {"le": "32.0"}),
            ("vllm:request_params_n", "vllm:request_params_n_sum", {}),
            ("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_bucket", {"le": "10.0"}),
            ("vllm:request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens_count", {})):
        assert _value(merged, family, sample, **labels) == _value(single, family, sample, **labels), (family, labels)
    assert _value(merged, "vllm:generation_tokens", "vllm:generation_tokens_total") == 15 * 7
    itl = ("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_bucket")
    assert _value(merged, *itl, le="0.025") == 15 * 2 and _value(merged, *itl, le="+Inf") == 15 * 4
    per_process = {p: _value(merged, "pagedllm:api_server_requests", "pagedllm:api_server_requests_total",
                             api_server=p) for p in ("0", "1")}
    assert per_process == {"0": 6, "1": 9}
    # the engine's own numbers: the renderer's latest stats, as the engine reported them (not x 2 processes)
    assert _value(merged, "vllm:num_requests_running", "vllm:num_requests_running", engine="0") == 3
    assert _value(merged, "vllm:num_preemptions", "vllm:num_preemptions_total", engine="0") == 2
    assert _value(merged, "pagedllm:engine_aborted_requests", "pagedllm:engine_aborted_requests_total") == 5
    assert _value(merged, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 40
    assert _value(merged, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum") == 15 * 17
    assert _value(merged, "vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 15 * 7
    # the cache config: once per engine core, as the renderer's engines said (not once per process)
    info = sorted((dict(lbls)["engine"], dict(lbls)["num_gpu_blocks"], v)
                  for _, lbls, v in merged["vllm:cache_config_info"][1])
    assert info == [("0", "90", 1.0), ("1", "91", 1.0)]
