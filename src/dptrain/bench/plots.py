"""PNG plots of benchmark results and projections (matplotlib, Agg backend: no display needed).

Each plot_* function takes result rows and a path, draws one figure and writes it; nothing else.
The *_series functions say what a plot draws (tested without reading images). Summary rows
judged unreliable (results.unreliable) are drawn with a red ring or a dashed line, named in the legend.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from dptrain.bench.results import flags, summarise  # noqa: E402

DPI = 80
SIZE = (6.4, 3.6)
UNRELIABLE = "unreliable (see table)"


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def _label(row: dict) -> str:
    return row["strategy"] if row["network"] == "loopback" else f"{row['strategy']} ({row['network']})"


def scaling_series(summary: list[dict]) -> list[dict]:
    """One line per strategy (and network) of the scaling plot: workers, speedup, efficiency and,
    per point, whether its row is unreliable."""
    lines: dict[str, list[dict]] = {}
    for row in summary:
        if row.get("speedup") is not None:
            lines.setdefault(_label(row), []).append(row)
    series = []
    for label, rows in lines.items():
        rows = sorted(rows, key=lambda r: r["workers"])
        series.append({"label": label, "workers": [r["workers"] for r in rows], "speedup": [r["speedup"] for r in rows],
                       "efficiency": [r["efficiency"] for r in rows], "unreliable": [bool(flags(r)) for r in rows]})
    return series


def plot_scaling(summary: list[dict], path: Path) -> Path:
    """Speedup and scaling efficiency against workers, one line per strategy; unreliable points ringed in red."""
    figure, (left, right) = plt.subplots(1, 2, figsize=SIZE)
    flagged = False
    for line in scaling_series(summary):
        left.plot(line["workers"], line["speedup"], marker="o", label=line["label"])
        right.plot(line["workers"], line["efficiency"], marker="o", label=line["label"])
        for axes, key in ((left, "speedup"), (right, "efficiency")):
            points = [(w, v) for w, v, bad in zip(line["workers"], line[key], line["unreliable"]) if bad]
            if points:
                axes.scatter(*zip(*points), s=140, facecolors="none", edgecolors="red", linewidths=1.5, zorder=3,
                             label=None if flagged else UNRELIABLE)
                flagged = True
    every = sorted({row["workers"] for row in summary})
    left.plot(every, every, color="grey", linestyle=":", label="ideal")
    right.axhline(1.0, color="grey", linestyle=":")
    left.set(xlabel="workers", ylabel="speedup vs 1 worker", xticks=every)
    right.set(xlabel="workers", ylabel="scaling efficiency", xticks=every)
    handles, labels = left.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i] == UNRELIABLE)  # that entry last
    left.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=7)
    return _save(figure, path)


def accuracy_series(runs: list[dict], summary: list[dict] | None = None) -> list[dict]:
    """The curves of the accuracy-against-time plot: the first repeat of every strategy and baseline
    at 1 worker and at the largest worker count, each with whether its summary row is unreliable."""
    summary = summarise(runs) if summary is None else summary
    judged = {(row["kind"], row["strategy"], row["workers"], row["network"]): bool(flags(row)) for row in summary}
    widest = max(row["workers"] for row in runs)
    series = []
    for row in runs:
        if row["repeat"] == 0 and row["workers"] in (1, widest) and row["curve"]:
            seconds, accuracy = zip(*row["curve"])
            bad = judged.get((row["kind"], row["strategy"], row["workers"], row["network"]), False)
            series.append({"label": f"{_label(row)}, {row['workers']} w" + (" (unreliable)" if bad else ""),
                           "strategy": _label(row), "workers": row["workers"], "seconds": list(seconds),
                           "accuracy": list(accuracy), "unreliable": bad})
    return series


def plot_accuracy_vs_time(runs: list[dict], path: Path, target: float | None = None,
                          summary: list[dict] | None = None) -> Path:
    """Test accuracy against training wall time (accuracy_series): one colour per strategy, a dotted
    line at 1 worker, a solid one at the largest count, dashed and labelled where unreliable."""
    figure, axes = plt.subplots(figsize=SIZE)
    colours: dict[str, str] = {}
    for curve in accuracy_series(runs, summary):
        colour = colours.setdefault(curve["strategy"], f"C{len(colours) % 10}")
        style = "--" if curve["unreliable"] else (":" if curve["workers"] == 1 else "-")
        axes.plot(curve["seconds"], curve["accuracy"], marker="x" if curve["unreliable"] else ".", color=colour,
                  linestyle=style, label=curve["label"])
    if target is not None:
        axes.axhline(target, color="grey", linestyle=":", label=f"target {target:g}")
    axes.set(xlabel="training wall time (s)", ylabel="test accuracy")
    axes.legend(fontsize=7)
    return _save(figure, path)


def plot_bytes(summary: list[dict], path: Path) -> Path:
    """Bytes communicated per run (all workers), per strategy, at the largest worker count."""
    figure, axes = plt.subplots(figsize=SIZE)
    widest = max(row["workers"] for row in summary)
    rows = [row for row in summary if row["workers"] == widest and row.get("comm_bytes")]
    axes.bar([_label(row) for row in rows], [row["comm_bytes"] for row in rows], color="tab:blue")
    axes.set_yscale("log")
    axes.set(ylabel=f"bytes sent, {widest} workers", xlabel="strategy")
    axes.tick_params(axis="x", labelsize=7)
    return _save(figure, path)


def plot_projection(rows: list[dict], path: Path) -> Path:
    """Projected epoch time and scaling efficiency against workers (log scale), one line per strategy."""
    figure, (left, right) = plt.subplots(1, 2, figsize=SIZE)
    for strategy in dict.fromkeys(row["strategy"] for row in rows):
        mine = [row for row in rows if row["strategy"] == strategy]
        workers = [row["workers"] for row in mine]
        left.plot(workers, [row["epoch_seconds"] for row in mine], marker=".", label=strategy)
        right.plot(workers, [row["efficiency"] for row in mine], marker=".", label=strategy)
    for axes in (left, right):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("workers")
    left.set_yscale("log")
    left.set_ylabel("projected seconds per epoch")
    right.set_ylabel("projected scaling efficiency")
    left.legend(fontsize=7)
    return _save(figure, path)


def plot_throughput(rows: list[dict], path: Path) -> Path:
    """Images per second per worker (mean ± 1.96·std) against workers, one line per model."""
    figure, axes = plt.subplots(figsize=SIZE)
    for model in dict.fromkeys(row["model"] for row in rows):
        mine = sorted((row for row in rows if row["model"] == model), key=lambda r: r["workers"])
        axes.errorbar([r["workers"] for r in mine], [r["images_per_second_per_worker"] for r in mine],
                      yerr=[r["ci"] for r in mine], marker="o", capsize=3, label=model)
    axes.set(xlabel="workers", ylabel="images/s per worker", xticks=sorted({row["workers"] for row in rows}))
    axes.legend(fontsize=7)
    return _save(figure, path)
