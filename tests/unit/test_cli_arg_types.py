"""The CLI's flags refuse bad values at parse time with argparse's one-line error (they were tracebacks after a whole
benchmark run, runs that clamped them silently or dropped them, or a server refusing every request)."""
from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.cli.bench_offline import add_latency_args, add_throughput_args
from pagedllm.entrypoints.cli.bench_serve import add_args as add_bench_serve_args
from pagedllm.entrypoints.cli.clients import add_chat_args, add_complete_args


def _parser(add) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add(p)
    return p


@pytest.mark.parametrize("add, argv", [
    (add_latency_args, ["--num-iters", "0"]),
    (add_latency_args, ["--batch-size", "-1"]),
    (add_latency_args, ["--num-iters-warmup", "-1"]),
    (add_throughput_args, ["--num-prompts", "0"]),
    (add_throughput_args, ["--random-range-ratio", "1.5"]),
    (add_bench_serve_args, ["--metric-percentiles", "150"]),
    (add_bench_serve_args, ["--metric-percentiles", "abc"]),
    (add_bench_serve_args, ["--max-concurrency", "0"]),
    (add_bench_serve_args, ["--random-range-ratio", "-1"]),
    (add_bench_serve_args, ["--random-input-len", "0"]),
    # were accepted: a bad port or URL was reported as an unreachable server (exit 1), a timeout <= 0 or nan
    # failed every request of the run at once
    (add_bench_serve_args, ["--port", "-1"]),
    (add_bench_serve_args, ["--port", "70000"]),
    (add_bench_serve_args, ["--base-url", "notaurl"]),
    (add_bench_serve_args, ["--base-url", "127.0.0.1:8000"]),
    (add_bench_serve_args, ["--base-url", "http://127.0.0.1:99999"]),
    (add_bench_serve_args, ["--timeout", "0"]),
    (add_bench_serve_args, ["--timeout", "-1"]),
    (add_bench_serve_args, ["--timeout", "nan"]),
    (add_bench_serve_args, ["--temperature", "-1"]),  # (was every request's 400)
    (add_bench_serve_args, ["--temperature", "nan"]),
    # chat / complete: the server's 400 ended an interactive session at its first question
    (add_chat_args, ["--max-tokens", "0"]),
    (add_chat_args, ["--temperature", "-0.5"]),
    (add_complete_args, ["--max-tokens", "-3"]),
])
def test_bad_bench_values_are_parse_errors(add, argv, capsys):
    with pytest.raises(SystemExit):
        _parser(add).parse_args(argv)
    assert "error: argument" in capsys.readouterr().err


def test_good_bench_values_parse():
    args = _parser(add_bench_serve_args).parse_args(["--metric-percentiles", "50,99.9", "--random-range-ratio", "0.5",
                                                     "--max-concurrency", "8"])
    assert (args.metric_percentiles, args.random_range_ratio, args.max_concurrency) == ("50,99.9", 0.5, 8)
    assert _parser(add_latency_args).parse_args(["--num-iters-warmup", "0"]).num_iters_warmup == 0
    args = _parser(add_bench_serve_args).parse_args(["--base-url", "https://h.example/v1", "--port", "8001",
                                                     "--timeout", "2.5"])
    assert (args.base_url, args.port, args.timeout) == ("https://h.example/v1", 8001, 2.5)


@pytest.mark.parametrize("argv", [["--port", "99999"], ["--port", "-1"], ["--max-request-body-bytes", "0"],
                                  ["--served-model-name", ""], ["--served-model-name", "smol", "  "],
                                  # timeouts: were taken as given, so a negative one failed the start after the
                                  # engine's launch ("not ready within -1.0 s") and nan disabled the check
                                  ["--startup-timeout", "-1"], ["--startup-timeout", "0"],
                                  ["--startup-timeout", "nan"], ["--shutdown-timeout", "-5"],
                                  ["--shutdown-timeout", "nan"], ["--send-timeout", "-1"],
                                  ["--engine-dead-grace-period", "nan"], ["--engine-dead-grace-period", "x"],
                                  # a negative length sliced from the end: all the prompt but its last 5 chars
                                  ["--max-log-len", "-5"]])
def test_bad_serve_values_are_parse_errors(argv, capsys):
    from pagedllm.entrypoints.openai.cli_args import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p, positional_model=True)
    with pytest.raises(SystemExit):
        p.parse_args(["model", *argv])
    assert "error: argument" in capsys.readouterr().err


def test_good_serve_timeouts_parse():
    from pagedllm.entrypoints.openai.cli_args import add_serve_args

    p = add_serve_args(argparse.ArgumentParser(), positional_model=True)
    args = p.parse_args(["model", "--startup-timeout", "600", "--shutdown-timeout", "0", "--send-timeout", "0",
                         "--engine-dead-grace-period=-1", "--max-log-len", "0"])
    assert (args.startup_timeout, args.shutdown_timeout, args.send_timeout) == (600.0, 0.0, 0.0)
    assert (args.engine_dead_grace_period, args.max_log_len) == (-1.0, 0)


def _parse_error(add, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        _parser(add).parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_unknown_percentile_metrics_are_refused(capsys):
    """--percentile-metrics foo was dropped from the results without a word: refused, naming the metrics there are."""
    err = _parse_error(add_bench_serve_args, ["--percentile-metrics", "ttft,foo"], capsys)
    assert "argument --percentile-metrics: unknown metric 'foo'; the metrics are ttft, tpot, itl, e2el" in err
    args = _parser(add_bench_serve_args).parse_args(["--percentile-metrics", "ttft, e2el"])
    from pagedllm.entrypoints.cli.bench_serve import format_result, summarize

    block = format_result(summarize([], 1.0), None, float("inf"), args.percentile_metrics)
    assert "Mean TTFT (ms):" in block and "Mean E2EL (ms):" in block and "TPOT" not in block


def test_missing_local_tokenizer_is_a_parse_error(tmp_path, capsys):
    """A tokenizer written as a local path that is not there: argparse's error, not a traceback from the hub client."""
    err = _parse_error(add_bench_serve_args, ["--tokenizer", str(tmp_path / "nope")], capsys)
    assert f"argument --tokenizer: {tmp_path / 'nope'} does not exist" in err
    assert _parser(add_bench_serve_args).parse_args(["--tokenizer", "org/name"]).tokenizer == "org/name"


@pytest.mark.parametrize("add, flag, is_dir", [
    (add_bench_serve_args, "--result-filename", False), (add_bench_serve_args, "--plot", False),
    (add_bench_serve_args, "--plot-dir", True), (add_throughput_args, "--output-json", False),
    (add_latency_args, "--output-json", False),
])
def test_unwritable_outputs_are_parse_errors(add, flag: str, is_dir: bool, tmp_path, capsys):
    """Result paths are checked before the run (a bad one failed only after all of it): under a file, or a file where
    a folder must be (and the reverse), is argparse's error; missing folders are fine (they are made)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    bad = [str(a_file / "out.json"), str(a_file) if is_dir else str(tmp_path)]
    for path in bad:
        err = _parse_error(add, [flag, path], capsys)
        assert f"argument {flag}" in err and "cannot write" in err and f" {path}: " in err, err
    good = str(tmp_path / "new" / "folder" / ("plots" if is_dir else "out.json"))
    assert getattr(_parser(add).parse_args([flag, good]), flag[2:].replace("-", "_")) == good


def test_write_json_makes_folders(tmp_path):
    from pagedllm.entrypoints.cli.arg_types import write_json

    path = tmp_path / "a" / "b" / "r.json"
    write_json(str(path), {"x": 1})
    assert path.read_text().strip().startswith("{") and '"x": 1' in path.read_text()


def test_bench_serve_checks_tokenizer_and_result_path_before_the_server(tmp_path, capsys, monkeypatch):
    """An unusable --tokenizer or an unwritable default result path stops bench serve before it contacts the server
    (none listens on the port given) or runs anything."""
    from pagedllm.entrypoints.cli import bench_serve
    from pagedllm.entrypoints.server_process import free_port

    port = str(free_port())
    bad_tokenizer = tmp_path / "tok"
    bad_tokenizer.mkdir()
    (bad_tokenizer / "tokenizer_config.json").write_text("{not json")
    assert bench_serve.run(_parser(add_bench_serve_args).parse_args(["--port", port, "--tokenizer",
                                                                     str(bad_tokenizer)])) == 2
    err = capsys.readouterr().err
    assert f"error: --tokenizer {bad_tokenizer}: Could not load a tokenizer" in err and "cannot reach" not in err
    # --save-result alone writes bench-serve-<date>.json here: a folder of that name makes it unwritable
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench_serve.time, "strftime", lambda fmt: "now")
    (tmp_path / "bench-serve-now.json").mkdir()
    assert bench_serve.run(_parser(add_bench_serve_args).parse_args(["--port", port, "--save-result"])) == 2
    err = capsys.readouterr().err
    assert "error: cannot write the results to bench-serve-now.json: is a directory" in err, err


def test_metric_percentiles_are_computed_not_zero():
    """--metric-percentiles 50,99.9 printed 0.00 for both (only P90 / P95 / P99 were computed)."""
    from pagedllm.entrypoints.cli.bench_serve import RequestResult, format_result, summarize

    results = [RequestResult(True, 10, 5, ttft, ttft + 0.4, [0.1] * 4) for ttft in (0.1, 0.2, 0.3)]
    block = format_result(summarize(results, 1.0, "50,99.9"), None, float("inf"), "ttft", "50,99.9")
    assert "P50 TTFT (ms):                           200.00" in block, block
    assert "P99.9 TTFT (ms):                         299.80" in block, block
    # "99.90" was its own key (p99.90_ttft_ms) and label, not vLLM's p99.9_ttft_ms
    metrics = summarize(results, 1.0, "99.90,50.0")
    assert "p99.9_ttft_ms" in metrics and "p99.90_ttft_ms" not in metrics and "p50_ttft_ms" in metrics
    block = format_result(metrics, None, float("inf"), "ttft", "99.90,50.0")
    assert "P99.9 TTFT (ms):" in block and "P50 TTFT (ms):" in block, block


@pytest.mark.parametrize("run, argv", [
    ("run_throughput", ["--input-len", "300", "--num-prompts", "2"]),
    ("run_latency", ["--input-len", "200", "--output-len", "100"]),
])
def test_offline_bench_past_the_context_is_a_one_line_error(monkeypatch, capsys, run, argv):
    """A prompt longer than --max-model-len was a traceback out of LLM.generate (latency: outputs cut short)."""
    from pagedllm.entrypoints.cli import bench_offline

    class _LLM:
        engine = argparse.Namespace(max_model_len=256)

        def get_tokenizer(self):
            return None

        def generate(self, *args, **kwargs):
            raise ValueError("This model's maximum context length is 256 tokens.")

    monkeypatch.setattr(bench_offline, "_make_llm", lambda args: _LLM())
    monkeypatch.setattr("pagedllm.entrypoints.cli.bench_serve.vocab_token_pool", lambda tok: [5, 6])
    add = add_throughput_args if run == "run_throughput" else add_latency_args
    assert getattr(bench_offline, run)(_parser(add).parse_args(argv)) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "256" in err


@pytest.mark.parametrize("quick", ["hi", None])
def test_ctrl_c_while_an_answer_streams_quits_without_a_traceback(monkeypatch, capsys, quick):
    """`pagedllm chat` says "Ctrl-C to quit": pressed while an answer streamed, it was a KeyboardInterrupt
    traceback out of the HTTP client."""
    from pagedllm.entrypoints.cli import clients

    class _Completions:
        def create(self, **kwargs):
            raise KeyboardInterrupt

    client = argparse.Namespace(chat=argparse.Namespace(completions=_Completions()))
    monkeypatch.setattr(clients, "_client", lambda args: (client, "m"))
    monkeypatch.setattr("builtins.input", lambda prompt: "hello")
    args = clients.add_chat_args(argparse.ArgumentParser()).parse_args([] if quick is None else ["-q", quick])
    assert clients.run_chat(args) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_ctrl_c_in_any_subcommand_exits_130_without_a_traceback(monkeypatch, capsys):
    """bench serve / throughput / latency interrupted by Ctrl-C printed a KeyboardInterrupt traceback."""
    from pagedllm.entrypoints.cli import bench_offline, main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_offline, "run_latency", interrupted)
    with pytest.raises(SystemExit) as e:
        main.main(["bench", "latency"])
    assert e.value.code == 130 and capsys.readouterr().err.strip() == "interrupted"


@pytest.mark.parametrize("text, value", [("4096", 4096), ("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600),
                                         ("1m", 1_000_000), ("2G", 2 << 30), (" 8K ", 8192)])
def test_sizes_take_vllms_suffixes(text: str, value: int) -> None:
    from pagedllm.entrypoints.cli.arg_types import human_int

    assert human_int(text) == value


@pytest.mark.parametrize("text, fragment", [("1.5", "expected an integer"), ("k", "expected a number"),
                                            ("1.1K", "not a whole number"), ("12x", "expected an integer")])
def test_sizes_refuse_what_is_no_whole_number(text: str, fragment: str) -> None:
    from pagedllm.entrypoints.cli.arg_types import human_int

    with pytest.raises(argparse.ArgumentTypeError, match=fragment):
        human_int(text)


@pytest.mark.parametrize("models, tokenize, fragment", [
    # were a traceback (httpx.HTTPStatusError / KeyError) from the /tokenize fallback
    ([{"id": "m"}], (404, {"detail": "Not Found"}), "pass --tokenizer"),
    ([{"id": "m"}], (200, {"count": 3}), "pass --tokenizer"),
    # was a run whose every request named "model": null
    ([], (200, {"tokens": [5, 6]}), "lists no models"),
])
def test_bench_serve_without_tokenize_or_models_is_a_one_line_error(models, tokenize, fragment, monkeypatch, capsys):
    import httpx

    from pagedllm.entrypoints.cli import bench_serve

    status, body = tokenize
    monkeypatch.setattr(bench_serve, "_server_info", lambda base_url, api_key: models)
    monkeypatch.setattr(httpx, "post", lambda url, **kw: httpx.Response(status, json=body,
                                                                        request=httpx.Request("POST", url)))
    monkeypatch.setattr(bench_serve, "run_benchmark", lambda *a, **kw: pytest.fail("the run should not start"))
    args = _parser(add_bench_serve_args).parse_args(["--num-prompts", "1", "--disable-tqdm"])
    assert bench_serve.run(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and len(err.strip().splitlines()) == 1, err


def test_a_config_file_that_is_not_utf8_is_a_parse_error(tmp_path, capsys):
    """A binary or Latin-1 --config file was a UnicodeDecodeError traceback."""
    from pagedllm.entrypoints.openai.cli_args import add_serve_args, parse_serve_args

    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"served-model-name: caf\xe9\n")
    p = add_serve_args(argparse.ArgumentParser(), positional_model=True)
    with pytest.raises(SystemExit) as e:
        parse_serve_args(p, ["model", "--config", str(cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --config" in err and "not UTF-8" in err, err


def test_bench_latency_percentiles_interpolate_as_vllms():
    """vLLM takes np.percentile (linear): the nearest-rank pick gave P50 of [1, 2] as 1.0 and P10 of
    [1, 2, 3, 4] as 1.0 (both rounded to a sample)."""
    from pagedllm.entrypoints.cli.bench_offline import latency_percentiles

    assert latency_percentiles([1.0, 2.0]) == pytest.approx(
        {"10": 1.1, "25": 1.25, "50": 1.5, "75": 1.75, "90": 1.9, "99": 1.99})
    assert latency_percentiles([1.0, 2.0, 3.0, 4.0])["10"] == pytest.approx(1.3)
    assert latency_percentiles([7.0]) == {k: 7.0 for k in ("10", "25", "50", "75", "90", "99")}


def test_bench_result_file_writes_the_request_rate_as_vllm():
    import json

    from pagedllm.entrypoints.cli.bench_serve import _result_record

    args = _parser(add_bench_serve_args).parse_args(["--num-prompts", "2"])
    records = [_result_record(args, {"completed": 2}, "m", "http://h", rate, 0) for rate in (8.0, float("inf"))]
    assert [json.loads(json.dumps(r))["request_rate"] for r in records] == [8.0, "inf"]  # (was "8.0")
