"""Time lost per failure: live membership (--min-workers) against restarting every worker (--max-restarts, torchrun).

    python benchmarks/elastic.py --runs 10 --strategies sync fedavg   # writes benchmarks/results/elastic/

Each dptrain run is a real `dptrain train` (digits, 4 workers, 8 epochs, a checkpoint every epoch). In a
faulted run one worker (rank 0, 1, 2 or 3: rank 0 too, since the launcher serves the store) is killed with
SIGKILL after a random training step (DPTRAIN_FAULT=step@RANK:STEP, once). Kinds of run, interleaved so
that load drifts hit all alike:

- clean: no fault (the reference wall time and accuracy);
- survive: --min-workers 3: the survivors leave the failed group, agree on who is left and redo the epoch
  the worker died in;
- restart: --max-restarts 1: the launcher stops every worker and starts all four again from the last
  complete checkpoint;
- torchrun-clean and torchrun-restart: PyTorch's own fault-tolerant recipe, a textbook DDP script that
  saves a snapshot every epoch (benchmarks/baselines/textbook_ddp.py --snapshot) under
  `torchrun --standalone --nproc-per-node 4 --max-restarts 1` (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
  without it the restarted gloo workers of torch 2.13 fail to connect), the same rank killed after the same step
  ("worker failures are handled by restarting all workers"). Not the same training (allreduce each
  step): its time lost is measured against its own clean runs.

Time lost = the run's wall time minus the median clean wall time of its own kind (dptrain or torchrun).
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
KINDS = ("clean", "survive", "restart", "torchrun-clean", "torchrun-restart")
TEXTBOOK = Path(__file__).parent / "baselines" / "textbook_ddp.py"


def run_once(kind: str, strategy: str, out: Path, rank: int, step: int) -> dict:
    faulted = kind not in ("clean", "torchrun-clean")
    env = dict(os.environ)
    if kind.startswith("torchrun"):
        out.mkdir(parents=True)
        torchrun = Path(sys.executable).with_name("torchrun")
        argv = [str(torchrun), "--standalone", "--nproc-per-node", str(WORKERS), "--max-restarts", "1",
                str(TEXTBOOK), "--epochs", str(EPOCHS), "--snapshot", str(out / "snapshot.pt")]
        # torch 2.13's torchrun shares its rendezvous store with the workers, and restarted gloo workers then
        # connect to the first attempt's addresses and fail (pytorch/pytorch#135712, #167288): its workaround.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if faulted:
            env["DPTRAIN_BENCH_KILL"] = f"{rank}:{step}"
    else:
        argv = [sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--strategy", strategy,
                "--workers", str(WORKERS), "--epochs", str(EPOCHS), "--lr", "0.05", "--no-progress",
                "--out", str(out)]
        if faulted:
            env.update(DPTRAIN_FAULT=f"step@{rank}:{step}", DPTRAIN_FAULT_ONCE=str(out.parent / f"{out.name}.fired"))
        argv += {"clean": [], "survive": ["--min-workers", str(WORKERS - 1)], "restart": ["--max-restarts", "1"]}[kind]
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - began
    if kind.startswith("torchrun"):
        said = [line for line in done.stdout.splitlines() if line.startswith("test accuracy ")]
        accuracy, workers = (float(said[-1].split()[-1]) if said else None), WORKERS
    else:
        summary = json.loads((out / "summary.json").read_text()) if done.returncode == 0 else {}
        accuracy, workers = summary.get("test_accuracy"), summary.get("workers")
    return {"kind": kind, "strategy": "allreduce (torchrun)" if kind.startswith("torchrun") else strategy,
            "rank": rank if faulted else None, "step": step if faulted else None, "exit": done.returncode,
            "wall_seconds": wall, "test_accuracy": accuracy, "workers_at_end": workers,
            "restarted": "restarting the" in done.stderr or "Restarting" in done.stderr,
            "continued": "continuing from epoch" in done.stdout + done.stderr}


def report(results: list[dict], strategy: str) -> str:
    """The table of one strategy's runs (the torchrun runs were made alongside them)."""
    results = [r for r in results if r["strategy_run"] == strategy]
    lines = [f"### {strategy}", "",
             "| run | n | exit 0 | time lost, median (s) | min–max (s) | test accuracy, median | vs its clean runs |",
             "|-----|---|--------|-----------------------|-------------|-----------------------|-------------------|"]
    lost = {}
    for kind in KINDS:
        clean_kind = "torchrun-clean" if kind.startswith("torchrun") else "clean"
        reference = statistics.median(r["wall_seconds"] for r in results if r["kind"] == clean_kind)
        clean_accuracy = statistics.median(r["test_accuracy"] for r in results
                                           if r["kind"] == clean_kind and r["test_accuracy"] is not None)
        runs = [r for r in results if r["kind"] == kind]
        ok = [r for r in runs if r["exit"] == 0 and r["test_accuracy"] is not None]
        losses = [r["wall_seconds"] - reference for r in ok]
        lost[kind] = statistics.median(losses) if losses else float("nan")
        acc = statistics.median(r["test_accuracy"] for r in ok) if ok else float("nan")
        spread = f"{min(losses):.1f}–{max(losses):.1f}" if losses and "clean" not in kind else "–"
        shown = 0.0 if "clean" in kind else lost[kind]
        lines.append(f"| {kind} | {len(runs)} | {len(ok)} | {shown:.1f} | {spread} | {acc:.4f} | "
                     f"{acc - clean_accuracy:+.4f} |")
    survive = lost["survive"]
    lines += ["", f"Restarting every worker lost {lost['restart'] / survive:.1f}x, torchrun's restart of the textbook "
                  f"script {lost['torchrun-restart'] / survive:.1f}x the time that going on without the lost one did."
              if survive > 0 else "Going on without the lost worker lost no time at the median."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each kind per strategy (default 10)")
    parser.add_argument("--strategies", nargs="+", default=["sync", "fedavg"], choices=["sync", "fedavg"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "elastic"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = []
    total, done = args.runs * len(args.strategies) * len(KINDS), 0
    with tempfile.TemporaryDirectory() as scratch:
        for strategy in args.strategies:
            for index in range(args.runs):
                rank, step = rng.randint(0, WORKERS - 1), rng.randint(1, EPOCHS * STEPS_PER_EPOCH - 1)
                for kind in KINDS:
                    result = run_once(kind, strategy, Path(scratch) / f"{strategy}-{kind}-{index}", rank, step)
                    result["strategy_run"] = strategy
                    results.append(result)
                    done += 1
                    print(f"[{done}/{total}] {json.dumps(result)}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    tables = "\n\n".join(report(results, strategy) for strategy in args.strategies)
    (out / "README.md").write_text("# Time lost per failure: live membership against restarting all\n\n"
                                   "Made by `python benchmarks/elastic.py` (see its docstring for the set-up).\n\n"
                                   + tables + "\n")
    print(tables)


if __name__ == "__main__":
    main()
