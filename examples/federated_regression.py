"""The reference work's federated regression scenario, run with dptrain and recorded as a table.

An 8-feature tabular set (synthetic-regression), the MLP 8-128-256-512-256-128-1 with a
sigmoid output (mlp-regression), MSE, Adam lr 2e-4, 32 epochs, fixed partitions (no
shuffling across workers), on 1, 2 and 4 workers; fedavg (contiguous and iid partitions)
against sync and async weight averaging on fixed shards.

    .venv/bin/python examples/federated_regression.py --out runs/federated-regression
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runs_table import run_all, write_table

COMMON = ["--dataset", "synthetic-regression", "--model", "mlp-regression", "--optimizer", "adam", "--lr", "2e-4",
          "--batch-size", "32", "--epochs", "32", "--seed", "0"]
RUNS = [("1 worker (reference)", "sync", 1, ["--shuffle", "none"])] + [
    (label, strategy, workers, extra)
    for workers in (2, 4)
    for label, strategy, extra in (
        ("fedavg, contiguous partitions", "fedavg", ["--partition", "contiguous"]),
        ("fedavg, iid partitions", "fedavg", ["--partition", "iid"]),
        ("sync, fixed shards", "sync", ["--shuffle", "local"]),
        ("async, fixed shards", "async", ["--shuffle", "local"]),
    )
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/federated-regression")
    args = parser.parse_args()
    out = Path(args.out)
    write_table(out, run_all(out, RUNS, COMMON), "test_loss", "test MSE", 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
