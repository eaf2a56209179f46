"""Compare `dptrain bench` result directories of the streaming study: time to accuracy thresholds, final
accuracy, time blocked in waits, one plot of every run's accuracy against time.

    python benchmarks/streaming_compare.py OUT.json LABEL=DIR[:STRATEGY,...] ...

Each LABEL=DIR names a bench output (its results.json); `:STRATEGY,...` keeps only those strategies. A
configuration is shown as 'LABEL STRATEGY'. Time to a threshold is the training wall time of the first
epoch whose test accuracy reached it (from each run's recorded curve), averaged over the repeats that
reached it; the ratio is allreduce's mean over the configuration's, allreduce of the same LABEL, or for a LABEL
BASE-VARIANT without one, BASE's. `waited_seconds` (streaming only)
comes from each run's summary.json when the run directory is still there.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

THRESHOLDS = (0.75, 0.85, 0.9)


def first_at(curve: list[list[float]], threshold: float):
    return next((seconds for seconds, accuracy in curve if accuracy is not None and accuracy >= threshold), None)


def load(spec: str) -> list[dict]:
    label, _, rest = spec.partition("=")
    directory, _, only = rest.partition(":")
    results = json.loads((Path(directory) / "results.json").read_text())
    keep = set(only.split(",")) if only else None
    runs = []
    for run in results["runs"]:
        if run["kind"] != "dptrain" or (keep and run["strategy"] not in keep):
            continue
        summary_path = Path(directory) / run["run_dir"] / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        runs.append({"config": f"{label} {run['strategy']}".strip(), "strategy": run["strategy"],
                     "repeat": run["repeat"], "curve": run["curve"], "final_accuracy": run["final_accuracy"],
                     "wall_seconds": run["wall_seconds"], "epoch_seconds": run["epoch_seconds"],
                     "comm_bytes": run["comm_bytes"],
                     "waited_seconds": summary.get("strategy_results", summary).get("waited_seconds")})
    return runs


def main(out: str, specs: list[str]) -> None:
    runs = [run for spec in specs for run in load(spec)]
    configs = list(dict.fromkeys(run["config"] for run in runs))
    table = []
    for config in configs:
        mine = [run for run in runs if run["config"] == config]
        row = {"config": config, "runs": len(mine),
               "final_accuracy": statistics.mean(run["final_accuracy"] for run in mine),
               "median_epoch_seconds": statistics.median(run["epoch_seconds"] for run in mine),
               "wall_seconds": statistics.mean(run["wall_seconds"] for run in mine),
               "comm_bytes": mine[0]["comm_bytes"]}
        waits = [run["waited_seconds"] for run in mine if run["waited_seconds"] is not None]
        row["waited_seconds"] = statistics.mean(waits) if waits else None
        for threshold in THRESHOLDS:
            times = [t for t in (first_at(run["curve"], threshold) for run in mine) if t is not None]
            row[f"time_to_{threshold:g}"] = statistics.mean(times) if times else None
            row[f"reached_{threshold:g}"] = f"{len(times)}/{len(mine)}"
        table.append(row)
    references = {row["config"].rsplit(" ", 1)[0]: row for row in table if row["config"].endswith("allreduce")}
    for row in table:
        label = row["config"].rsplit(" ", 1)[0]
        reference = references.get(label) or references.get(label.split("-")[0])
        for threshold in THRESHOLDS:
            key = f"time_to_{threshold:g}"
            row[f"allreduce_over_{threshold:g}"] = (reference[key] / row[key]) if reference and reference[key] \
                and row[key] else None
    Path(out).write_text(json.dumps({"configs": table, "runs": runs}, indent=1))

    bases = list(dict.fromkeys(config.rsplit(" ", 1)[0].split("-")[0] for config in configs))
    figure, panels = plt.subplots(1, len(bases), figsize=(6.5 * len(bases), 5), squeeze=False)
    for index, config in enumerate(configs):
        axes = panels[0][bases.index(config.rsplit(" ", 1)[0].split("-")[0])]
        for number, run in enumerate(run for run in runs if run["config"] == config):
            seconds, accuracy = zip(*run["curve"])
            axes.plot(seconds, accuracy, color=f"C{index}", marker=".", alpha=0.8,
                      label=config if number == 0 else None)
    for base, axes in zip(bases, panels[0]):
        for threshold in (0.75, 0.9):
            axes.axhline(threshold, color="grey", linestyle=":")
        axes.set(xlabel="training wall time (s)", ylabel="test accuracy", title=f"{base}: 2 hosts at 100 Mbit/s")
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(Path(out).with_suffix(".png"), dpi=110)

    header = ["config", "runs", "final_accuracy", *[f"time_to_{t:g}" for t in THRESHOLDS],
              *[f"allreduce_over_{t:g}" for t in THRESHOLDS], "median_epoch_seconds", "waited_seconds", "comm_bytes"]
    print("| " + " | ".join(header) + " |")
    for row in table:
        cells = [f"{row[key]:.3f}" if isinstance(row[key], float) else str(row[key]) for key in header]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
