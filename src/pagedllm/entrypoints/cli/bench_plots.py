"""PNG plots of `pagedllm bench serve` / `bench sweep` results (matplotlib, the optional `plot` extra).

One run: TTFT / TPOT / ITL / end-to-end latency distributions and output throughput over time (with the number of
requests in flight); `--plot FILE` puts them on one figure, `--plot-dir DIR` writes one file each plus that figure.
A sweep over request rates: achieved throughput against the offered rate, and latency (median, P99) against
throughput. Every file is written to a temporary name next to its target and renamed into place once all of a
call's figures rendered, so a failure leaves no half-written image.

matplotlib is imported only here, through `require_matplotlib()`, which the commands call before they start (a
missing matplotlib stops them at once with one sentence, before any request is sent).
"""
from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Optional, Sequence

MISSING_MESSAGE = ("error: plotting needs matplotlib, which is not installed; install it with "
                   "`pip install 'pagedllm[plot]'` (or `pip install matplotlib`).")
# One-run files written by --plot-dir (the combined figure is SUMMARY).
SERVE_FILES = ("ttft.png", "tpot.png", "itl.png", "e2el.png", "throughput.png")
SUMMARY = "summary.png"
SWEEP = "sweep.png"
DPI = 100
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


class PlotUnavailable(RuntimeError):
    pass


def require_matplotlib() -> None:
    """PlotUnavailable(MISSING_MESSAGE) when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError:
        raise PlotUnavailable(MISSING_MESSAGE) from None


def _figure(width: float, height: float) -> Any:
    # A bare Figure (no pyplot): no global state and no GUI backend, safe in any process.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


# ---- one run --------------------------------------------------------------------------------------------------

def _latencies_ms(results: Sequence[Any]) -> dict[str, list[float]]:
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft * 1000 for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1],
        "itl": [x * 1000 for r in ok for x in r.itl],
        "e2el": [r.latency * 1000 for r in ok],
    }


TITLES = {"ttft": "Time to first token", "tpot": "Time per output token (after the first)",
          "itl": "Inter-token latency", "e2el": "End-to-end latency"}


def _distribution(ax: Any, name: str, values: list[float], color: str) -> None:
    ax.set_title(TITLES[name], fontsize=10)
    ax.set_xlabel("ms")
    ax.set_ylabel("requests" if name != "itl" else "tokens")
    if not values:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    ax.hist(values, bins=min(40, max(5, len(values) // 2)), color=color, alpha=0.85)
    s = sorted(values)
    for q, style in ((50, "--"), (99, ":")):
        v = s[min(len(s) - 1, int(round((len(s) - 1) * q / 100)))]
        ax.axvline(v, color="black", linestyle=style, linewidth=1, label=f"P{q} {v:.1f} ms")
    ax.legend(fontsize=8)


def _timeline(results: Sequence[Any]) -> tuple[list[float], list[float], list[float], float]:
    """Bin centres (s since the first request), output tokens/s per bin, requests in flight per bin, bin width."""
    ok = [r for r in results if r.success]
    if not ok:
        return [], [], [], 0.0
    t0 = min(r.start_time for r in results)
    end = max(r.start_time + r.latency for r in ok) - t0
    width = max(end / 40, 1e-3)
    bins = max(1, math.ceil(end / width))
    tokens = [0.0] * bins
    for r in ok:
        times = r.chunk_times
        if not times:
            continue
        per_chunk = r.output_tokens / len(times)  # a chunk may carry several tokens: spread them evenly
        for t in times:
            tokens[min(bins - 1, int((t - t0) / width))] += per_chunk
    in_flight = [0.0] * bins
    for r in ok:
        a, b = r.start_time - t0, r.start_time - t0 + r.latency
        for i in range(bins):  # time-weighted share of each bin this request was open
            lo, hi = i * width, (i + 1) * width
            in_flight[i] += max(0.0, min(b, hi) - max(a, lo)) / width
    centres = [(i + 0.5) * width for i in range(bins)]
    return centres, [x / width for x in tokens], in_flight, width


def _throughput(ax: Any, results: Sequence[Any]) -> None:
    ax.set_title("Output throughput over time", fontsize=10)
    ax.set_xlabel("s since the first request")
    ax.set_ylabel("output tokens/s", color=COLORS[0])
    centres, rate, in_flight, width = _timeline(results)
    if not centres:
        ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
        return
    ax.bar(centres, rate, width=width * 0.95, color=COLORS[0], alpha=0.8)
    twin = ax.twinx()
    twin.plot(centres, in_flight, color=COLORS[3], linewidth=1.5)
    twin.set_ylabel("requests in flight", color=COLORS[3])
    twin.set_ylim(bottom=0)


def _summary_figure(results: Sequence[Any], title: str) -> Any:
    lat = _latencies_ms(results)
    fig = _figure(11, 7.5)
    axes = fig.subplots(3, 2)
    for ax, name, color in zip(axes.flat, ("ttft", "tpot", "itl", "e2el"), COLORS):
        _distribution(ax, name, lat[name], color)
    gs = axes[2, 0].get_gridspec()
    for ax in axes[2]:
        ax.remove()
    _throughput(fig.add_subplot(gs[2, :]), results)
    fig.suptitle(title, fontsize=11)
    return fig


def _single_figure(results: Sequence[Any], name: str, title: str) -> Any:
    fig = _figure(7, 4)
    ax = fig.subplots()
    if name == "throughput":
        _throughput(ax, results)
    else:
        _distribution(ax, name, _latencies_ms(results)[name], COLORS[("ttft", "tpot", "itl", "e2el").index(name)])
    fig.suptitle(title.replace(": ", ":\n", 1), fontsize=9)  # two lines: a narrow figure
    return fig


def serve_title(metrics: dict, model: str, max_concurrency: Optional[int], request_rate: float) -> str:
    rate = "inf" if request_rate == float("inf") else f"{request_rate:g}"
    return (f"{short_name(model)}: {metrics['completed']} requests, concurrency {max_concurrency or 'unlimited'}, "
            f"rate {rate}/s; {metrics['output_throughput']:.1f} output tok/s")


def short_name(model: str) -> str:
    """A served name that is a path (a model served without --served-model-name): its last part."""
    return os.path.basename(model.rstrip("/")) if os.sep in model else model


# ---- a sweep --------------------------------------------------------------------------------------------------

def _rate_label(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def _sweep_figure(rows: Sequence[tuple[float, dict]], title: str) -> Any:
    fig = _figure(13, 4.2)
    a, b, c = fig.subplots(1, 3)
    labels = [_rate_label(rate) for rate, _ in rows]
    xs = list(range(len(rows)))
    a.plot(xs, [m["output_throughput"] for _, m in rows], marker="o", color=COLORS[0], label="output tok/s")
    a.set_xticks(xs, labels)
    a.set_xlabel("offered request rate (req/s)")
    a.set_ylabel("output tokens/s")
    a.set_title("Throughput vs offered rate", fontsize=10)
    twin = a.twinx()
    twin.plot(xs, [m["request_throughput"] for _, m in rows], marker="s", linestyle="--", color=COLORS[1])
    twin.set_ylabel("completed req/s", color=COLORS[1])
    throughput = [m["output_throughput"] for _, m in rows]
    for ax, metric, name in ((b, "ttft", "Time to first token"), (c, "tpot", "Time per output token")):
        for stat, color, marker in (("median", COLORS[2], "o"), ("p99", COLORS[3], "^")):
            ax.plot(throughput, [m[f"{stat}_{metric}_ms"] for _, m in rows], marker=marker, color=color,
                    label=stat.replace("p99", "P99"))
        for x, (rate, m) in zip(throughput, rows):
            ax.annotate(_rate_label(rate), (x, m[f"median_{metric}_ms"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("ms")
        ax.set_title(f"{name} vs throughput", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig


# ---- writing --------------------------------------------------------------------------------------------------

def _write_all(figures: list[tuple[Any, str]]) -> list[str]:
    """Render every figure to a temporary file beside its target, then rename them all into place."""
    staged: list[tuple[str, str]] = []
    try:
        for fig, path in figures:
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".bench-plot-", suffix=".png", dir=folder)
            os.close(fd)
            staged.append((tmp, path))
            fig.savefig(tmp, format="png", metadata={"Software": None})
        for tmp, path in staged:
            os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.remove(tmp)
    return [path for _, path in figures]


def write_serve_plots(results: Sequence[Any], title: str, plot: Optional[str] = None,
                      plot_dir: Optional[str] = None) -> list[str]:
    figures: list[tuple[Any, str]] = []
    if plot:
        figures.append((_summary_figure(results, title), plot))
    if plot_dir:
        for name in SERVE_FILES:
            figures.append((_single_figure(results, name[:-4], title), os.path.join(plot_dir, name)))
        figures.append((_summary_figure(results, title), os.path.join(plot_dir, SUMMARY)))
    return _write_all(figures)


def write_sweep_plots(rows: Sequence[tuple[float, dict, Sequence[Any]]], title: str, plot: Optional[str] = None,
                      plot_dir: Optional[str] = None) -> list[str]:
    """rows: (request rate, metrics, per-request results) per rate. --plot: the curves; --plot-dir: the curves as
    sweep.png and each rate's summary as rate-<r>.png."""
    curve = [(rate, metrics) for rate, metrics, _ in rows]
    figures: list[tuple[Any, str]] = []
    if plot:
        figures.append((_sweep_figure(curve, title), plot))
    if plot_dir:
        figures.append((_sweep_figure(curve, title), os.path.join(plot_dir, SWEEP)))
        for rate, metrics, results in rows:
            figures.append((_summary_figure(results, f"{title}; rate {_rate_label(rate)}/s"),
                            os.path.join(plot_dir, f"rate-{_rate_label(rate)}.png")))
    return _write_all(figures)
