"""PNG plots of benchmark results and projections (matplotlib, Agg backend: no display needed).

Each function takes result rows and a path, draws one figure and writes it; nothing else.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

DPI = 80
SIZE = (6.4, 3.6)


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def _label(row: dict) -> str:
    return row["strategy"] if row["network"] == "loopback" else f"{row['strategy']} ({row['network']})"


def plot_scaling(summary: list[dict], path: Path) -> Path:
    """Speedup and scaling efficiency against workers, one line per strategy."""
    figure, (left, right) = plt.subplots(1, 2, figsize=SIZE)
    lines: dict[str, list[dict]] = {}
    for row in summary:
        if row.get("speedup") is not None:
            lines.setdefault(_label(row), []).append(row)
    for label, rows in lines.items():
        rows = sorted(rows, key=lambda r: r["workers"])
        workers = [r["workers"] for r in rows]
        left.plot(workers, [r["speedup"] for r in rows], marker="o", label=label)
        right.plot(workers, [r["efficiency"] for r in rows], marker="o", label=label)
    every = sorted({row["workers"] for row in summary})
    left.plot(every, every, color="grey", linestyle=":", label="ideal")
    left.set(xlabel="workers", ylabel="speedup vs 1 worker", xticks=every)
    right.set(xlabel="workers", ylabel="scaling efficiency", xticks=every)
    left.legend(fontsize=7)
    return _save(figure, path)


def plot_accuracy_vs_time(runs: list[dict], path: Path, target: float | None = None) -> Path:
    """Test accuracy against training wall time, one curve per strategy at the largest worker count (first repeat)."""
    figure, axes = plt.subplots(figsize=SIZE)
    widest = max(row["workers"] for row in runs)
    for row in runs:
        if row["repeat"] == 0 and (row["workers"] == widest or row["strategy"] == "plain-loop") and row["curve"]:
            seconds, accuracy = zip(*row["curve"])
            axes.plot(seconds, accuracy, marker=".", label=f"{_label(row)}, {row['workers']} w")
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
