"""Time lost per failure: live membership (--min-workers) against restarting every worker (--max-restarts).

    python benchmarks/elastic.py --runs 10            # writes benchmarks/results/elastic/{results.json,README.md}

Each run is a real `dptrain train` (sync, digits, 4 workers, 8 epochs, a checkpoint every epoch). In a
faulted run one worker (rank 1, 2 or 3) is killed with SIGKILL after a random training step
(DPTRAIN_FAULT=step@RANK:STEP, once). Three kinds of run, interleaved so that load drifts hit all alike:

- clean: no fault (the reference wall time and accuracy);
- survive: --min-workers 3: the survivors leave the failed group, agree on who is left and redo the epoch
  the worker died in;
- restart: --max-restarts 1: the launcher stops every worker and starts all four again from the last
  complete checkpoint (torchrun's elastic agent does the same: "restarting all workers").

Time lost = the run's wall time minus the median clean wall time. Rank 0 (the store's host) is never the
one killed: losing it still needs a restart.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKERS, EPOCHS = 4, 8
STEPS_PER_EPOCH = 12  # digits: 1437 training rows over 4 workers, batch 32
KINDS = ("clean", "survive", "restart")


def run_once(kind: str, out: Path, rank: int, step: int) -> dict:
    argv = [sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--strategy", "sync",
            "--workers", str(WORKERS), "--epochs", str(EPOCHS), "--lr", "0.05", "--no-progress", "--out", str(out)]
    env = dict(os.environ)
    if kind != "clean":
        env.update(DPTRAIN_FAULT=f"step@{rank}:{step}", DPTRAIN_FAULT_ONCE=str(out.parent / f"{out.name}.fired"))
    argv += {"clean": [], "survive": ["--min-workers", str(WORKERS - 1)], "restart": ["--max-restarts", "1"]}[kind]
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - began
    summary = json.loads((out / "summary.json").read_text()) if done.returncode == 0 else {}
    return {"kind": kind, "rank": rank if kind != "clean" else None, "step": step if kind != "clean" else None,
            "exit": done.returncode, "wall_seconds": wall, "test_accuracy": summary.get("test_accuracy"),
            "workers_at_end": summary.get("workers"),
            "restarted": "restarting the" in done.stderr, "continued": "continuing from epoch" in done.stdout + done.stderr}


def report(results: list[dict]) -> str:
    clean = [r["wall_seconds"] for r in results if r["kind"] == "clean"]
    reference = statistics.median(clean)
    accuracy = statistics.median(r["test_accuracy"] for r in results if r["kind"] == "clean")
    lines = ["| run | n | exit 0 | time lost, median (s) | min–max (s) | test accuracy, median | vs clean |",
             "|-----|---|--------|-----------------------|-------------|-----------------------|----------|"]
    lost = {}
    for kind in KINDS:
        runs = [r for r in results if r["kind"] == kind]
        ok = [r for r in runs if r["exit"] == 0]
        losses = [r["wall_seconds"] - reference for r in ok]
        lost[kind] = statistics.median(losses) if losses else float("nan")
        accuracies = [r["test_accuracy"] for r in ok]
        acc = statistics.median(accuracies) if accuracies else float("nan")
        spread = f"{min(losses):.1f}–{max(losses):.1f}" if losses else "–"
        lines.append(f"| {kind} | {len(runs)} | {len(ok)} | {lost[kind] if kind != 'clean' else 0:.1f} | "
                     f"{spread if kind != 'clean' else '–'} | {acc:.4f} | {acc - accuracy:+.4f} |")
    ratio = lost["restart"] / lost["survive"] if lost["survive"] > 0 else float("inf")
    lines += ["", f"Clean wall time, median: {reference:.1f} s. Restarting every worker lost {ratio:.1f}x the time "
                  "that going on without the lost one did."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each kind (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "elastic"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.runs):
            rank, step = rng.randint(1, WORKERS - 1), rng.randint(1, EPOCHS * STEPS_PER_EPOCH - 1)
            for kind in KINDS:
                result = run_once(kind, Path(scratch) / f"{kind}-{index}", rank, step)
                results.append(result)
                print(json.dumps(result), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = report(results)
    (out / "README.md").write_text("# Time lost per failure: live membership against restarting all\n\n"
                                   "Made by `python benchmarks/elastic.py` (see its docstring for the set-up).\n\n"
                                   + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
