"""The CLI's numeric flags refuse bad values at parse time with argparse's one-line error (they were tracebacks after
a whole benchmark run, runs that clamped them silently, or a server refusing every request)."""
from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.cli.bench_offline import add_latency_args, add_throughput_args
from pagedllm.entrypoints.cli.bench_serve import add_args as add_bench_serve_args


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


@pytest.mark.parametrize("argv", [["--port", "99999"], ["--port", "-1"], ["--max-request-body-bytes", "0"],
                                  ["--served-model-name", ""], ["--served-model-name", "smol", "  "]])
def test_bad_serve_values_are_parse_errors(argv, capsys):
    from pagedllm.entrypoints.openai.cli_args import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p, positional_model=True)
    with pytest.raises(SystemExit):
        p.parse_args(["model", *argv])
    assert "error: argument" in capsys.readouterr().err
