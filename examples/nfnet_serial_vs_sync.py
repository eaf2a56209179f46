"""The epoch-averaging system's image case: the NFNet classifier, one worker against sync on 2 and 4.

Equal epochs for every run (the reference system's comparison: does averaging at epoch ends keep
the accuracy of one worker?), on synthetic-images (10 classes, 32 x 32 RGB, 2,048 samples; no
download), SGD with momentum, the same per-worker batch and learning rate; sync averages every
epoch, and every 2 epochs. The table goes to OUT/results.md.

    .venv/bin/python examples/nfnet_serial_vs_sync.py --out runs/nfnet --epochs 10
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runs_table import run_all, write_table

COMMON = ["--dataset", "synthetic-images", "--model", "nfnet", "--optimizer", "sgd", "--lr", "0.05",
          "--momentum", "0.9", "--grad-clip", "1.0", "--batch-size", "32", "--seed", "0", "--no-progress",
          "--checkpoint-every", "0", "--lr-scaling", "none"]  # the same LR as one worker, as recorded in nfnet.md
RUNS = [("serial (1 worker)", "allreduce", 1, [])] + [
    (f"sync every {every} epoch{'s' if every > 1 else ''}", "sync", workers, ["--sync-every", str(every)])
    for workers in (2, 4) for every in (1, 2)
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/nfnet")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    out = Path(args.out)
    write_table(out, run_all(out, RUNS, [*COMMON, '--epochs', str(args.epochs)]), "test_accuracy", "test accuracy", 4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
