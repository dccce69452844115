"""`pagedllm bench serve --plot / --plot-dir` and `pagedllm bench sweep` against a real server (the tiny random
llama on the CPU): the PNGs are read back with Pillow (format, size, not blank, several colours); without
matplotlib the command stops with one sentence, exit code 2, before any request and without writing a file."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from e2e_helpers import cli, metric, serving

from pagedllm.entrypoints.cli.bench_plots import DPI, MISSING_MESSAGE, SERVE_FILES, SUMMARY, SWEEP

pytest.importorskip("matplotlib", reason="the plot extra (pip install 'pagedllm[plot]') is part of [test]")
Image = pytest.importorskip("PIL.Image", reason="Pillow reads the plots back; it is part of [test]")

SMALL = ["--num-prompts", "8", "--max-concurrency", "4", "--random-input-len", "16", "--random-output-len", "8",
         "--ignore-eos", "--disable-tqdm"]


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir: str, e2e_env: dict, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-plots")
    with serving(tiny_llama_dir, ["--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20),
                                  "--max-num-seqs", "8"], str(tmp / "server.log"), e2e_env) as url:
        yield url


def bench(url: str, env: dict, *args: str, command: str = "serve") -> subprocess.CompletedProcess:
    return subprocess.run([cli("pagedllm"), "bench", command, "--base-url", url, *args], capture_output=True,
                          text=True, timeout=300, env=env)


def check_png(path, size_inches: tuple[float, float], hues: int = 3) -> None:
    """A real PNG of the figure's size in pixels, not blank: several colours, a fair share of non-white pixels,
    and at least `hues` saturated colours (a one-histogram figure has one hue: how many shades of it its bars'
    edges leave depends on the data)."""
    assert os.path.isfile(path), path
    with Image.open(path) as img:
        assert img.format == "PNG"
        assert img.size == (round(size_inches[0] * DPI), round(size_inches[1] * DPI)), img.size
        rgb = img.convert("RGB")
        colors = rgb.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) >= 8, f"{path}: {len(colors or [])} distinct colours"
    white = sum(n for n, c in colors if c == (255, 255, 255))
    assert white < 0.97 * img.size[0] * img.size[1], f"{path} is nearly blank"
    # colours that are neither grey nor white: the bars and lines, not only text and axes
    assert len([c for n, c in colors if n > 50 and max(c) - min(c) > 60]) >= hues, path


def test_bench_serve_plot(tiny_server: str, e2e_env: dict, tmp_path) -> None:
    out = tmp_path / "out.png"
    r = bench(tiny_server, e2e_env, *SMALL, "--plot", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Serving Benchmark Result" in r.stdout and "Successful requests:                     8" in r.stdout
    check_png(out, (11, 7.5))
    assert [p.name for p in tmp_path.iterdir()] == ["out.png"]  # no temporary file left behind


def test_bench_serve_plot_dir(tiny_server: str, e2e_env: dict, tmp_path) -> None:
    folder = tmp_path / "plots" / "run1"  # created as needed
    r = bench(tiny_server, e2e_env, *SMALL, "--plot-dir", str(folder))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(folder)) == sorted([*SERVE_FILES, SUMMARY])
    for name in SERVE_FILES:
        check_png(folder / name, (7, 4), hues=1)
    check_png(folder / SUMMARY, (11, 7.5))


def test_bench_sweep_curve_and_table(tiny_server: str, e2e_env: dict, tmp_path) -> None:
    curve, folder, saved = tmp_path / "curve.png", tmp_path / "sweep", tmp_path / "sweep.json"
    r = bench(tiny_server, e2e_env, *SMALL, "--request-rate", "50,inf", "--plot", str(curve), "--plot-dir",
              str(folder), "--result-filename", str(saved), command="sweep")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("Serving Benchmark Result") == 2
    table = r.stdout[r.stdout.index("Request-rate sweep"):].splitlines()
    assert table[1].split()[:3] == ["rate", "(req/s)", "ok"]
    assert [line.split()[:3] for line in table[2:4]] == [["50", "8", "0"], ["inf", "8", "0"]]
    check_png(curve, (13, 4.2))
    assert sorted(os.listdir(folder)) == sorted([SWEEP, "rate-50.png", "rate-inf.png"])
    check_png(folder / SWEEP, (13, 4.2))
    check_png(folder / "rate-inf.png", (11, 7.5))
    records = json.loads(saved.read_text())["sweep"]
    assert [(x["request_rate"], x["completed"], x["total_output_tokens"]) for x in records] == \
        [(50.0, 8, 64), ("inf", 8, 64)]  # vLLM's: a number, "inf" only for inf (was the text "50.0")


def test_bench_serve_with_several_rates_is_a_sweep(tiny_server: str, e2e_env: dict, tmp_path) -> None:
    curve = tmp_path / "curve.png"
    r = bench(tiny_server, e2e_env, *SMALL, "--request-rate", "100,inf", "--plot", str(curve))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Request-rate sweep" in r.stdout
    check_png(curve, (13, 4.2))


def test_bad_request_rate_is_refused(tiny_server: str, e2e_env: dict) -> None:
    r = bench(tiny_server, e2e_env, *SMALL, "--request-rate", "4,fast")
    assert r.returncode == 2 and "'fast' is not a request rate" in r.stderr, r.stderr
    r = bench(tiny_server, e2e_env, *SMALL, "--request-rate", "0")
    assert r.returncode == 2 and "request rates must be > 0" in r.stderr, r.stderr


@pytest.mark.parametrize("flag", ["--plot", "--plot-dir"])
def test_missing_matplotlib_stops_before_the_benchmark(tiny_server: str, e2e_env: dict, tmp_path, flag) -> None:
    """matplotlib blocked in the client process (a None entry in sys.modules makes its import fail)."""
    target = tmp_path / ("out.png" if flag == "--plot" else "plots")
    before = httpx.get(tiny_server + "/metrics").text
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from pagedllm.entrypoints.cli.main import main\n"
            f"main(['bench', 'serve', '--base-url', {tiny_server!r}, *{SMALL!r}, {flag!r}, {str(target)!r}])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=e2e_env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip() == MISSING_MESSAGE and "\n" not in MISSING_MESSAGE
    assert r.stdout == "" and list(tmp_path.iterdir()) == []
    after = httpx.get(tiny_server + "/metrics").text
    assert metric(after, "vllm:prompt_tokens_total") == metric(before, "vllm:prompt_tokens_total")
