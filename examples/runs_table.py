"""What the example comparisons share: run `dptrain train` once per setting (skipping runs already
done) and write one Markdown table of their summaries to OUT/results.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence


def run_all(out: Path, runs: Sequence[tuple[str, str, int, list[str]]], common: list[str]) -> list[tuple[str, int, dict]]:
    """(label, workers, summary.json) of each (label, strategy, workers, extra flags) run, in order."""
    done = []
    for index, (label, strategy, workers, extra) in enumerate(runs):
        run_dir = out / f"{index:02d}-{strategy}-{workers}"
        command = [sys.executable, "-m", "dptrain", "train", *common, "--strategy", strategy,
                   "--workers", str(workers), *extra, "--out", str(run_dir)]
        if not (run_dir / "summary.json").exists():  # rerunning the script only does what is missing
            print(" ".join(command[2:]), flush=True)
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        done.append((label, workers, json.loads((run_dir / "summary.json").read_text())))
    return done


def write_table(out: Path, results: list[tuple[str, int, dict]], metric: str, heading: str, digits: int) -> str:
    """The results as a Markdown table (run, workers, `metric`, wall time, bytes), also written to OUT/results.md."""
    lines = [f"| run | workers | {heading} | wall (s) | bytes communicated |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {label} | {workers} | {summary[metric]:.{digits}f} | {summary['wall_seconds']:.1f} | "
              f"{summary['comm_bytes']:,} |" for label, workers, summary in results]
    table = "\n".join(lines)
    (out / "results.md").write_text(table + "\n")
    print(table)
    return table
