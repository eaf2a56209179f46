"""`dptrain demo`: digits on two local workers under allreduce and under sync, side by side."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

from rich.console import Console
from rich.table import Table

from dptrain.io import timestamped
from dptrain.train.rundir import claim_run_dir

STRATEGIES = ("allreduce", "sync")


def demo(workers: int = 2, epochs: int = 10, out: str | None = None) -> int:
    root = claim_run_dir(out or timestamped("runs", "demo"))
    console = Console()
    summaries = {}
    for strategy in STRATEGIES:
        run_dir = root / strategy
        console.print(f"[bold]dptrain train --strategy {strategy} --workers {workers} --epochs {epochs}[/bold]")
        command = [sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--model", "mlp",
                   "--strategy", strategy, "--workers", str(workers), "--epochs", str(epochs),
                   "--batch-size", "32", "--lr", "0.05", "--seed", "0", "--out", str(run_dir)]
        code = subprocess.call(command)
        if code != 0:
            console.print(f"[red]the {strategy} run failed with exit code {code}[/red]")
            return code
        summaries[strategy] = json.loads((run_dir / "summary.json").read_text())

    table = Table(title=f"digits, mlp, {workers} workers, {epochs} epochs")
    for column in ("strategy", "test accuracy", "wall time (s)", "bytes communicated", "samples/s"):
        table.add_column(column, justify="right")
    for strategy, summary in summaries.items():
        table.add_row(strategy, f"{summary['test_accuracy']:.4f}", f"{summary['wall_seconds']:.2f}",
                      f"{summary['comm_bytes']:,}", f"{summary['samples_per_second']:,.0f}")
    console.print(table)
    ratio = summaries["allreduce"]["comm_bytes"] / max(summaries["sync"]["comm_bytes"], 1)
    console.print(f"sync communicated {ratio:.1f}x fewer bytes than allreduce.")
    # soft_wrap: a long path is never broken across lines (it stays one thing to copy).
    plot = shlex.join(["dptrain", "plot", str(root / "allreduce"), str(root / "sync")])
    console.print(f"The two runs are in {root}; to see their curves: {plot}", soft_wrap=True, highlight=False,
                  markup=False)
    return 0
