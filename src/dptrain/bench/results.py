"""Benchmark results: one row per run from its run directory, scaling against 1 worker, means over repeats, CSV/JSON.

Pure functions of summary/metrics dicts, so aggregation is tested without running anything.
A run directory is a dptrain run (summary.json, metrics.jsonl) or a baseline script's, which
writes the same two files with the keys used here.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Optional

from dptrain.io import write_json

RUN_COLUMNS = ("kind", "strategy", "workers", "repeat", "network", "epochs", "final_accuracy", "time_to_target_seconds",
               "wall_seconds", "process_seconds", "epoch_seconds", "samples_per_second",
               "samples_per_second_per_worker", "comm_bytes", "speedup", "efficiency", "model_parameters",
               "train_samples", "batch_size", "run_dir")
# A summary row is judged unreliable when its efficiency is above this, or when the spread of its
# wall time (or time to target) over repeats is wider than the mean. Linear scaling is the ceiling
# for these CPU runs, so an efficiency above 1 means the 1-worker time it is measured against was
# slowed by something else (a busy machine), not that the run was fast. The 5 % margin absorbs the
# averaging: a row's efficiency is the mean of its repeats' ratios, and that mean exceeds 1 at one
# worker whenever the repeats differ at all (1.05 for two repeats 22 % either side of their mean).
EFFICIENCY_LIMIT = 1.05


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return summary, [json.loads(line) for line in lines if line.strip()]


def time_to_target(metrics: list[dict], target: Optional[float]) -> Optional[float]:
    """Training seconds until the first evaluated epoch with test accuracy >= target (None: never)."""
    if target is None:
        return None
    for record in metrics:
        accuracy = record.get("test_accuracy")
        if accuracy is not None and accuracy >= target:
            return record["wall_seconds"]
    return None


def run_row(summary: dict, metrics: list[dict], *, kind: str, repeat: int, network: str, target: Optional[float],
            process_seconds: float, train_samples: int, batch_size: int, run_dir: str = "") -> dict:
    """One results row: what a run measured, in the units of RUN_COLUMNS (speedup filled in later)."""
    workers = summary["workers"]
    epoch_times = [record["epoch_seconds"] for record in metrics if record.get("epoch_seconds") is not None]
    return {
        "kind": kind,
        # --strategy auto trains as the strategy it chose: auto:sync is its own row, not one of sync's repeats
        "strategy": (f"auto:{summary['strategy']}" if "auto" in (summary.get("strategy_options") or {})
                     else summary["strategy"]),
        "workers": workers,
        "repeat": repeat,
        "network": network,
        "epochs": summary.get("epochs", len(metrics)),
        "final_accuracy": summary.get("test_accuracy"),
        "time_to_target_seconds": time_to_target(metrics, target),
        "wall_seconds": summary["wall_seconds"],
        "process_seconds": process_seconds,
        # The median resists the first epoch's warm-up and a neighbour's burst on a shared machine.
        "epoch_seconds": statistics.median(epoch_times) if epoch_times else None,
        "samples_per_second": summary.get("samples_per_second"),
        "samples_per_second_per_worker": (summary["samples_per_second"] / workers
                                          if summary.get("samples_per_second") is not None else None),
        "comm_bytes": summary.get("comm_bytes"),
        "speedup": None,
        "efficiency": None,
        "model_parameters": summary.get("model_parameters"),
        "train_samples": train_samples,
        "batch_size": batch_size,
        "run_dir": run_dir,
        "curve": [(record["wall_seconds"], record["test_accuracy"]) for record in metrics
                  if record.get("test_accuracy") is not None],
    }


def add_scaling(rows: list[dict]) -> list[dict]:
    """Speedup (1-worker wall time / this wall time) and efficiency (speedup / workers).

    The reference is the mean 1-worker wall time of the same strategy on the same network;
    a strategy without a 1-worker run (a baseline such as plain DDP) is compared with the
    plain single-process loop, else with dptrain's 1-worker allreduce.
    """
    def mean_wall(predicate) -> Optional[float]:
        walls = [row["wall_seconds"] for row in rows if row["workers"] == 1 and predicate(row)]
        return statistics.mean(walls) if walls else None

    for row in rows:
        reference = (mean_wall(lambda r: r["strategy"] == row["strategy"] and r["network"] == row["network"])
                     or mean_wall(lambda r: r["strategy"] == "plain-loop" and r["network"] == row["network"])
                     or mean_wall(lambda r: r["strategy"] == "allreduce" and r["network"] == row["network"]))
        if reference is not None and row["wall_seconds"]:
            row["speedup"] = reference / row["wall_seconds"]
            row["efficiency"] = row["speedup"] / row["workers"]
    return rows


def mean_and_ci(values: list[float]) -> tuple[Optional[float], Optional[float]]:
    """(mean, 1.96 · sample standard deviation); the spread is None for fewer than two values."""
    if not values:
        return None, None
    spread = 1.96 * statistics.stdev(values) if len(values) > 1 else None
    return statistics.mean(values), spread


def summarise(rows: list[dict]) -> list[dict]:
    """Means over repeats per (kind, strategy, workers, network), in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["kind"], row["strategy"], row["workers"], row["network"]), []).append(row)
    table = []
    for (kind, strategy, workers, network), runs in groups.items():
        def mean(key: str) -> Optional[float]:
            values = [run[key] for run in runs if run.get(key) is not None]
            return statistics.mean(values) if values else None

        reached = [run["time_to_target_seconds"] for run in runs if run["time_to_target_seconds"] is not None]
        to_target, to_target_ci = mean_and_ci(reached)
        wall, wall_ci = mean_and_ci([run["wall_seconds"] for run in runs])
        table.append({
            "kind": kind, "strategy": strategy, "workers": workers, "network": network, "runs": len(runs),
            "final_accuracy": mean("final_accuracy"), "time_to_target_seconds": to_target,
            "time_to_target_ci": to_target_ci, "reached_target": f"{len(reached)}/{len(runs)}",
            "wall_seconds": wall, "wall_seconds_ci": wall_ci, "epoch_seconds": mean("epoch_seconds"),
            "samples_per_second": mean("samples_per_second"),
            "samples_per_second_per_worker": mean("samples_per_second_per_worker"),
            "comm_bytes": mean("comm_bytes"), "speedup": mean("speedup"), "efficiency": mean("efficiency"),
        })
        table[-1]["unreliable"] = unreliable(table[-1])
    return table


def unreliable(row: dict) -> list[str]:
    """Why the figures of summary row `row` cannot be trusted (empty when nothing is wrong):
    an efficiency above EFFICIENCY_LIMIT, or a spread over repeats wider than the mean."""
    reasons = []
    efficiency = row.get("efficiency")
    if efficiency is not None and efficiency > EFFICIENCY_LIMIT:
        if row["workers"] == 1:
            reasons.append(f"efficiency {efficiency:.2f} above 1 at 1 worker: its repeats' wall times differ widely")
        else:
            reasons.append(f"efficiency {efficiency:.2f} above 1 (speedup {row['speedup']:.2f} on {row['workers']} "
                           "workers): faster than linear, so the 1-worker time it is measured against was slowed, "
                           "likely by a busy machine")
    for key, spread_key, what in (("wall_seconds", "wall_seconds_ci", "wall time"),
                                  ("time_to_target_seconds", "time_to_target_ci", "time to target")):
        mean, spread = row.get(key), row.get(spread_key)
        if mean is not None and spread is not None and spread > mean:
            reasons.append(f"{what} spread ±{spread:.3g} s (1.96 std over {row.get('runs', '?')} repeats) is wider "
                           f"than its mean {mean:.3g} s")
    return reasons


def flags(row: dict) -> list[str]:
    """The row's recorded judgement, or a fresh one for a row written before judgements were."""
    return row["unreliable"] if "unreliable" in row else unreliable(row)


def ratio(table: list[dict], key: str, numerator: tuple[str, int], denominator: tuple[str, int]) -> Optional[float]:
    """table[key] of (strategy, workers) `numerator` over that of `denominator` (None when either is missing)."""
    def value(which: tuple[str, int]) -> Optional[float]:
        found = [row[key] for row in table if (row["strategy"], row["workers"]) == which and row.get(key)]
        return found[0] if found else None

    top, bottom = value(numerator), value(denominator)
    return top / bottom if top is not None and bottom else None


def write_results(out: Path, rows: list[dict], table: list[dict], meta: dict) -> None:
    """results.csv (one line per run) and results.json (settings, runs with curves, means)."""
    with open(out / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=RUN_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _csv_value(row.get(key)) for key in RUN_COLUMNS})
    write_json(out / "results.json", {**meta, "runs": rows, "summary": table})


def _csv_value(value):
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return "" if value is None else value


def format_summary(table: list[dict], columns: tuple[str, ...]) -> str:
    """format_table of the means with a "note" column: "!" on each unreliable row, explained below the table."""
    marked = [{**row, "note": "!" if flags(row) else ""} for row in table]
    lines = [format_table(marked, (*columns, "note"))]
    for row in table:
        if flags(row):
            network = "" if row["network"] == "loopback" else f", {row['network']}"
            lines.append(f"! unreliable: {row['strategy']}, {row['workers']} worker{'s' if row['workers'] > 1 else ''}"
                         f"{network}: {'; '.join(flags(row))}")
    if len(lines) > 1:
        lines.append(f"! rows marked so have an efficiency above {EFFICIENCY_LIMIT:g} or a spread over repeats wider "
                     "than their mean; rerun them on an idle machine, with more --repeat")
    return "\n".join(lines)


def format_table(table: list[dict], columns: tuple[str, ...]) -> str:
    """A plain-text (Markdown) table of `columns`; floats to 4 significant digits, bytes with separators."""
    def cell(key: str, value) -> str:
        if value is None:
            return "-"
        if key.endswith("bytes") and isinstance(value, (int, float)):
            return f"{value:,.0f}"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in table:
        lines.append("| " + " | ".join(cell(key, row.get(key)) for key in columns) + " |")
    return "\n".join(lines)
