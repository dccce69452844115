"""benchmarks/plot_docs.py: the committed plots of docs/benchmarks.md are the ones the script makes, each shown
right after its table, each small; every number drawn is one the docs state; a table that moved is named."""
from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

pytest.importorskip("matplotlib", reason="the plot extra (pip install 'pagedllm[plot]') is part of [test]")
Image = pytest.importorskip("PIL.Image", reason="Pillow reads the plots back; it is part of [test]")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs", "benchmarks.md")
PLOTS_DIR = os.path.join(ROOT, "docs", "plots")
MAX_BYTES = 100 * 1024


def _script():
    spec = importlib.util.spec_from_file_location("plot_docs", os.path.join(ROOT, "benchmarks", "plot_docs.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _check_png(path: str) -> None:
    assert os.path.getsize(path) < MAX_BYTES, f"{path}: {os.path.getsize(path)} bytes"
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] >= 600 and img.size[1] >= 300, img.size
        colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is not None and len([c for n, c in colors if n > 50 and max(c) - min(c) > 60]) >= 2, path


def test_script_writes_every_plot(tmp_path) -> None:
    plot_docs = _script()
    assert plot_docs.main(["--out", str(tmp_path)]) == 0
    assert sorted(os.listdir(tmp_path)) == sorted(plot_docs.PLOTS)
    for name in plot_docs.PLOTS:
        _check_png(str(tmp_path / name))


def test_committed_plots_are_the_scripts_and_sit_after_their_tables() -> None:
    plot_docs = _script()
    assert sorted(os.listdir(PLOTS_DIR)) == sorted(plot_docs.PLOTS), "rerun python benchmarks/plot_docs.py"
    lines = open(DOCS).read().splitlines()
    for name in plot_docs.PLOTS:
        _check_png(os.path.join(PLOTS_DIR, name))
        refs = [i for i, line in enumerate(lines) if f"](plots/{name})" in line]
        assert len(refs) == 1, f"docs/benchmarks.md shows {name} {len(refs)} times"
        above = next(line for line in reversed(lines[:refs[0]]) if line.strip())
        assert above.startswith("|"), f"{name} is not right after a table (line above: {above!r})"


def _drawn_values(fig) -> list[float]:
    """Bar heights of the GPU plots (single numbers), dot positions of the plots with rounds (bars are means)."""
    values = []
    for ax in fig.axes:
        dots = [y for collection in ax.collections for _, y in collection.get_offsets()]
        values += dots or [bar.get_height() for bar in ax.patches]
    return values


def _stated(value: float, text: str) -> bool:
    forms = {f"{value:,.0f}", f"{value:,.1f}", f"{value:,.2f}", f"{value:,.3f}", f"{value:.1f}", f"{value:g}"}
    return any(re.search(rf"(?<!\d)(?<!\d[.,]){re.escape(form)}(?!\d|[.,]\d)", text) for form in forms)


def test_every_drawn_number_is_one_the_docs_state() -> None:
    plot_docs = _script()
    text = open(DOCS).read()
    tables = plot_docs.read_tables(text)
    for name, make in plot_docs.PLOTS.items():
        values = _drawn_values(make(tables))
        assert len(values) >= 4, name
        missing = [v for v in values if not _stated(v, text)]
        assert not missing, f"{name} draws numbers docs/benchmarks.md does not state: {missing}"


def test_a_missing_table_is_named() -> None:
    plot_docs = _script()
    tables = plot_docs.read_tables("## Server\n\nAgain with the tiled layout:\n\n| clients | ours |\n|---|---|\n"
                                   "| 8 | 1 tok/s |\n")
    assert tables[0].header == ["clients", "ours"] and tables[0].rows == [["8", "1 tok/s"]]
    assert tables[0].intro == "Again with the tiled layout:"
    with pytest.raises(SystemExit, match="no table under 'Server' with columns"):
        plot_docs.cpu_server_vs_llamacpp(tables)
