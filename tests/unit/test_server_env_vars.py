"""Environment variables of the logging and the HTTP server: PAGEDLLM_LOGGING_LEVEL (or vLLM's VLLM_LOGGING_LEVEL) sets
the offline LLM's logging level and the server's --log-level default; PAGEDLLM_HTTP_TIMEOUT_KEEP_ALIVE (or
VLLM_HTTP_TIMEOUT_KEEP_ALIVE) the keep-alive; a bad value is refused with a message naming the variable."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from pagedllm import envs

SCRIPT = """
import argparse, logging
from pagedllm.entrypoints.llm import _setup_logging
from pagedllm.entrypoints.openai.cli_args import add_serve_args
_setup_logging()
parser = add_serve_args(argparse.ArgumentParser(), positional_model=False)
print(logging.getLevelName(logging.getLogger("pagedllm").level), parser.parse_args([]).log_level)
"""


@pytest.mark.parametrize("env, expected", [({}, "INFO info"),
                                           ({"PAGEDLLM_LOGGING_LEVEL": "warning"}, "WARNING warning"),
                                           ({"VLLM_LOGGING_LEVEL": "DEBUG"}, "DEBUG debug"),
                                           ({"PAGEDLLM_LOGGING_LEVEL": "error", "VLLM_LOGGING_LEVEL": "DEBUG"},
                                            "ERROR error")])
def test_logging_level_from_the_environment(env, expected, monkeypatch):
    for name in ("PAGEDLLM_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == expected.split()


def test_a_bad_level_is_refused_by_name(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "loud")
    with pytest.raises(ValueError, match="VLLM_LOGGING_LEVEL='LOUD' is not a logging level"):
        envs.PAGEDLLM_LOGGING_LEVEL
    assert logging.getLevelName("INFO") == logging.INFO


@pytest.mark.parametrize("env, expected", [({}, 5.0), ({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "30"}, 30.0),
                                           ({"PAGEDLLM_HTTP_TIMEOUT_KEEP_ALIVE": "2.5",
                                             "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "30"}, 2.5)])
def test_http_keep_alive_from_the_environment(env, expected, monkeypatch):
    for name in ("PAGEDLLM_HTTP_TIMEOUT_KEEP_ALIVE", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert envs.PAGEDLLM_HTTP_TIMEOUT_KEEP_ALIVE == expected


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_keep_alive_is_refused_by_name(value, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", value)
    with pytest.raises(ValueError, match="VLLM_HTTP_TIMEOUT_KEEP_ALIVE=.*positive number of seconds"):
        envs.PAGEDLLM_HTTP_TIMEOUT_KEEP_ALIVE


def test_the_cli_reports_a_bad_level_without_a_traceback(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "loud")
    code = "from pagedllm.entrypoints.cli.main import main; main(['serve', '-h'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.strip() == ("error: VLLM_LOGGING_LEVEL='LOUD' is not a logging level; use one of CRITICAL, "
                                  "ERROR, WARNING, INFO, DEBUG.")


def test_serve_refuses_a_bad_keep_alive_before_loading_the_model(monkeypatch, tmp_path):
    """The variable was read only when uvicorn was configured: after the model loaded, and as a traceback. Now
    it is refused with the flags (exit 2), before the model (here one that does not exist) is looked at."""
    monkeypatch.delenv("PAGEDLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "abc")
    code = f"from pagedllm.entrypoints.cli.main import main; main(['serve', {str(tmp_path / 'no-model')!r}])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "VLLM_HTTP_TIMEOUT_KEEP_ALIVE='abc'" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("name, value, expected", [
    # int()'s "invalid literal for int() with base 10: 'abc'" named no variable (seen as an engine start failure)
    ("PAGEDLLM_DUMMY_WEIGHT_SEED", "abc", "PAGEDLLM_DUMMY_WEIGHT_SEED='abc': expected an integer"),
    ("LOCAL_RANK", "1.5", "LOCAL_RANK='1.5': expected an integer"),
    # float()'s message named none either, and 0 / -1 / nan were taken: collectives timing out at once, or never
    ("PAGEDLLM_DIST_TIMEOUT_S", "abc", "PAGEDLLM_DIST_TIMEOUT_S='abc': expected a positive number of seconds"),
    ("PAGEDLLM_DIST_TIMEOUT_S", "0", "PAGEDLLM_DIST_TIMEOUT_S='0'"),
    ("PAGEDLLM_NODE_JOIN_TIMEOUT_S", "nan", "PAGEDLLM_NODE_JOIN_TIMEOUT_S='nan'"),
])
def test_bad_numeric_variables_are_refused_by_name(name, value, expected, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as e:
        getattr(envs, name)
    assert expected in str(e.value)


def test_numeric_variables_read_and_default(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_DIST_TIMEOUT_S", "12.5")
    monkeypatch.setenv("PAGEDLLM_DUMMY_WEIGHT_SEED", "7")
    monkeypatch.setenv("LOCAL_RANK", "")
    monkeypatch.delenv("PAGEDLLM_NODE_JOIN_TIMEOUT_S", raising=False)
    assert (envs.PAGEDLLM_DIST_TIMEOUT_S, envs.PAGEDLLM_DUMMY_WEIGHT_SEED) == (12.5, 7)
    assert (envs.LOCAL_RANK, envs.PAGEDLLM_NODE_JOIN_TIMEOUT_S) == (0, 300.0)
