"""How far apart async runs land: test accuracy over seeds and repeated runs, beside sync.

    python benchmarks/async_variance.py benchmarks/results/async_variance.json

Async results depend on the order merges arrive in, so the same seed gives different runs;
sync is deterministic per seed. Two settings: the MLP on digits (10 epochs, the README's
reproducibility claim) and the cnn with a 3x straggler (5 epochs, the README's straggler example).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {
    "mlp-10-epochs": ["--model", "mlp", "--epochs", "10"],
    "cnn-5-epochs-straggler": ["--model", "cnn", "--epochs", "5", "--slow-worker", "1:3"],
}
SEEDS = range(5)
REPEATS = 2


def accuracy(args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--workers", "2",
                        "--no-progress", *args, "--out", f"{tmp}/run"], check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(f"{tmp}/run/summary.json").read_text())["test_accuracy"]


def main() -> int:
    results = {}
    for name, args in SETTINGS.items():
        rows = []
        for seed in SEEDS:
            sync = accuracy([*args, "--strategy", "sync", "--seed", str(seed)])
            runs = [accuracy([*args, "--strategy", "async", "--seed", str(seed)]) for _ in range(REPEATS)]
            rows.append({"seed": seed, "sync": sync, "async": runs})
            print(f"{name} seed {seed}: sync {sync:.4f} async {' '.join(f'{a:.4f}' for a in runs)}", flush=True)
        every_async = [a for row in rows for a in row["async"]]
        results[name] = {
            "args": args, "runs": rows,
            "async_min": min(every_async), "async_max": max(every_async),
            "async_mean": statistics.mean(every_async), "async_std": statistics.stdev(every_async),
            "largest_same_seed_gap": max(max(r["async"]) - min(r["async"]) for r in rows),
            "sync_mean": statistics.mean(r["sync"] for r in rows),
            "sync_std": statistics.stdev(r["sync"] for r in rows),
        }
    Path(sys.argv[1]).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
