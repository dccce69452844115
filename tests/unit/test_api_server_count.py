"""`--api-server-count`: the default for the machine (1 on small machines and CPU engines; on a GPU one per two
cores the engine leaves free, at most 4), explicit values, refusals, and where the processes' channels lie."""
from __future__ import annotations

import pytest

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.ipc import IPCLayout
from pagedllm.entrypoints.openai import api_server_manager as mgr


def _args(**kw) -> EngineArgs:
    return EngineArgs(model="m", **kw)


@pytest.mark.parametrize("cpus, expected", [(1, 1), (2, 1), (4, 1), (6, 2), (8, 3), (16, 4), (128, 4)])
def test_default_on_one_gpu(cpus: int, expected: int) -> None:
    assert mgr.default_api_server_count(_args(device="cuda"), cpus=cpus) == expected


def test_default_counts_the_engines_busy_processes() -> None:
    # tp=2: the engine core and its 2 worker ranks each keep a core busy
    assert mgr.default_api_server_count(_args(device="cuda", tensor_parallel_size=2), cpus=8) == 2
    # two data-parallel engine cores
    assert mgr.default_api_server_count(_args(device="cuda", data_parallel_size=2), cpus=8) == 3


def test_default_is_one_when_the_model_runs_on_the_cpu() -> None:
    assert mgr.default_api_server_count(_args(device="cpu"), cpus=64) == 1


def test_explicit_counts_and_refusals() -> None:
    from argparse import Namespace

    assert mgr.resolve_api_server_count(Namespace(api_server_count=3), _args(device="cpu")) == 3
    assert mgr.resolve_api_server_count(Namespace(api_server_count=None), _args(device="cpu")) == 1
    with pytest.raises(ValueError, match="at least 1"):
        mgr.resolve_api_server_count(Namespace(api_server_count=0), _args())


def test_the_flag_on_the_command_line_and_in_the_config_file(tmp_path, capsys) -> None:
    import argparse

    from pagedllm.entrypoints.openai.api_server import run
    from pagedllm.entrypoints.openai.cli_args import add_serve_args, parse_serve_args, to_engine_args

    def parse(argv: list[str]) -> argparse.Namespace:
        return parse_serve_args(add_serve_args(argparse.ArgumentParser(), positional_model=True), argv)

    assert parse(["m", "--api-server-count", "2"]).api_server_count == 2
    assert parse(["m", "-asc", "3"]).api_server_count == 3
    config = tmp_path / "serve.yaml"
    config.write_text("api-server-count: 4\n")
    args = parse(["m", "--config", str(config)])
    assert args.api_server_count == 4
    to_engine_args(args)  # a server flag, not an engine argument
    assert run(parse(["m", "--api-server-count", "0"])) == 2  # refused before anything loads
    assert "--api-server-count must be at least 1" in capsys.readouterr().err


def test_cgroup_quota_caps_the_cpus(monkeypatch) -> None:
    monkeypatch.setattr(mgr, "_cgroup_cpu_quota", lambda: 1.5)
    assert mgr.available_cpus() <= 2
    monkeypatch.setattr(mgr, "_cgroup_cpu_quota", lambda: None)
    assert mgr.available_cpus() >= 1


def test_channel_layout() -> None:
    layout = IPCLayout("/tmp/d", num_clients=2, num_engines=2)
    assert layout.engine_inputs(1) == ["ipc:///tmp/d/in-0-1.sock", "ipc:///tmp/d/in-1-1.sock",
                                       "ipc:///tmp/d/ctl-1.sock"]
    assert layout.engine_outputs() == ["ipc:///tmp/d/out-0.sock", "ipc:///tmp/d/out-1.sock"]
    assert len({layout.input(c, e) for c in range(2) for e in range(2)}) == 4
