"""Time lost per failure: live membership (--min-workers) against restarting every worker (--max-restarts, torchrun).

    python benchmarks/elastic.py          # writes benchmarks/results/elastic/ (README.md, results.json)

Each dptrain run is a real `dptrain train` (digits, 4 workers, 20 epochs of 12 steps, a checkpoint every
epoch) under each of --strategies (default: sync, fedavg, allreduce, streaming). In a faulted run one worker
(rank 0, 1, 2 or 3: rank 0 too, since the launcher serves the store) is killed with SIGKILL after a random
training step of the whole run (DPTRAIN_FAULT=step@RANK:STEP, once); the faulted kinds of one strategy and
round share that (rank, step). Kinds of run:

- clean: no fault (the reference wall time and accuracy); --reference-runs per strategy (default 5);
- survive: --min-workers 3: the survivors leave the failed group, agree on who is left and redo the epoch
  the worker died in; --runs per strategy (default 20);
- replace: --workers 3:4 (torchrun's MIN:MAX): as survive, and the launcher starts a new worker in place
  of the failed one, which joins at an epoch end and heals from rank 0; --replace-runs per strategy
  (default 10). Each result says whether a worker joined (a metrics.jsonl record whose "membership" has
  "joined") and how many workers were live at the end (summary.json "workers");
- restart: --max-restarts 1: the launcher stops every worker and starts all four again from the last
  complete checkpoint; --reference-runs per strategy;
- torchrun-clean and torchrun-restart: PyTorch's own fault-tolerant recipe, a textbook DDP script that
  saves a snapshot every epoch (benchmarks/baselines/textbook_ddp.py --snapshot) under
  `torchrun --standalone --nproc-per-node 4 --max-restarts 1` (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
  without it the restarted gloo workers of torch 2.13 fail to connect), a random rank killed after a
  random step ("worker failures are handled by restarting all workers"). Not the same training
  (allreduce each step) and strategy-independent: --reference-runs in all, shown in every strategy's
  table; its time lost is measured against its own clean runs.

All kinds are interleaved so that load drifts hit all alike: round i runs, for every strategy, each kind
whose runs are spread evenly over the rounds and falls in round i. results.json and README.md are written
again after every round, so a stopped benchmark leaves what it measured.

Time lost = the run's wall time minus the median clean wall time of its own kind (dptrain or torchrun).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKERS, EPOCHS = 4, 20
STEPS_PER_EPOCH = 12  # digits: 1437 training rows over 4 workers, batch 32
KINDS = ("clean", "survive", "replace", "restart", "torchrun-clean", "torchrun-restart")
STRATEGIES = ("sync", "fedavg", "allreduce", "streaming")
TEXTBOOK = Path(__file__).parent / "baselines" / "textbook_ddp.py"
TIMEOUT = 600  # seconds a run may take before it counts as hung (its process group is killed)


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
        workers = f"{WORKERS - 1}:{WORKERS}" if kind == "replace" else str(WORKERS)
        argv = [sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--strategy", strategy,
                "--workers", workers, "--epochs", str(EPOCHS), "--lr", "0.05", "--no-progress",
                "--out", str(out)]
        if faulted:
            env.update(DPTRAIN_FAULT=f"step@{rank}:{step}", DPTRAIN_FAULT_ONCE=str(out.parent / f"{out.name}.fired"))
        argv += {"clean": [], "survive": ["--min-workers", str(WORKERS - 1)], "replace": [],
                 "restart": ["--max-restarts", "1"]}[kind]
    began = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=TIMEOUT)
        code = child.returncode
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the launcher and every worker it started
        stdout, stderr = child.communicate()
        code = "hung"
    wall = time.perf_counter() - began
    joined = None
    if kind.startswith("torchrun"):
        said = [line for line in stdout.splitlines() if line.startswith("test accuracy ")]
        accuracy, workers = (float(said[-1].split()[-1]) if said else None), WORKERS if said else None
    else:
        summary_path = out / "summary.json"
        summary = json.loads(summary_path.read_text()) if code == 0 and summary_path.exists() else {}
        accuracy, workers = summary.get("test_accuracy"), summary.get("workers")
        if kind == "replace":
            metrics = out / "metrics.jsonl"
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
                if metrics.exists() else []
            joined = any((record.get("membership") or {}).get("joined") for record in records)
    result = {"kind": kind, "strategy": "allreduce (torchrun)" if kind.startswith("torchrun") else strategy,
              "rank": rank if faulted else None, "step": step if faulted else None, "exit": code,
              "wall_seconds": wall, "test_accuracy": accuracy, "workers_at_end": workers,
              "restarted": "restarting the" in stderr or "Restarting" in stderr,
              "continued": "continuing from epoch" in stdout + stderr}
    if kind == "replace":
        result["joined"] = joined
    if code != 0 or accuracy is None:
        result["stdout_tail"], result["stderr_tail"] = stdout[-2000:], stderr[-4000:]
    return result


def due(count: int, rounds: int, index: int) -> bool:
    """Whether round `index` of `rounds` holds one of `count` runs spread evenly over them (round 0 holds one)."""
    return math.ceil((index + 1) * count / rounds) > math.ceil(index * count / rounds)


def median(values: list) -> float:
    return statistics.median(values) if values else float("nan")


def measure(results: list[dict], strategy: str) -> dict:
    """Per kind: runs, finished runs, time lost (median, min, max), accuracy median and vs its clean runs."""
    results = [r for r in results if r["strategy_run"] in (strategy, None)]
    finished = {kind: [r for r in results if r["kind"] == kind and r["exit"] == 0 and r["test_accuracy"] is not None]
                for kind in KINDS}
    measured = {}
    for kind in KINDS:
        clean_kind = "torchrun-clean" if kind.startswith("torchrun") else "clean"
        reference = median([r["wall_seconds"] for r in finished[clean_kind]])
        clean_accuracy = median([r["test_accuracy"] for r in finished[clean_kind]])
        losses = [r["wall_seconds"] - reference for r in finished[kind]]
        accuracy = median([r["test_accuracy"] for r in finished[kind]])
        measured[kind] = {"runs": [r for r in results if r["kind"] == kind], "finished": len(finished[kind]),
                          "lost": 0.0 if "clean" in kind else median(losses),
                          "spread": (min(losses), max(losses)) if losses and "clean" not in kind else None,
                          "accuracy": accuracy, "vs_clean": accuracy - clean_accuracy}
    return measured


def ratio(slow: float, fast: float) -> str:
    return f"{slow / fast:.1f}" if fast > 0 and not math.isnan(slow) else "–"


def report(results: list[dict], strategy: str) -> str:
    """The table of one strategy's runs (the torchrun runs, made alongside every strategy's, are in each)."""
    measured = measure(results, strategy)
    lines = [f"### {strategy}", "",
             "| run | n | exit 0 | time lost, median (s) | min–max (s) | test accuracy, median | vs its clean runs |",
             "|-----|---|--------|-----------------------|-------------|-----------------------|-------------------|"]
    for kind in KINDS:
        m = measured[kind]
        spread = f"{m['spread'][0]:.1f}–{m['spread'][1]:.1f}" if m["spread"] else "–"
        lines.append(f"| {kind} | {len(m['runs'])} | {m['finished']} | {m['lost']:.1f} | {spread} | "
                     f"{m['accuracy']:.4f} | {m['vs_clean']:+.4f} |")
    replaced = measured["replace"]["runs"]
    survive = measured["survive"]["lost"]
    lines += ["", f"replace: {sum(r['workers_at_end'] == WORKERS for r in replaced)} of {len(replaced)} runs ended "
                  f"with {WORKERS} workers; a worker joined in {sum(bool(r.get('joined')) for r in replaced)}.",
              "", f"Time lost against survive: restart / survive {ratio(measured['restart']['lost'], survive)}x, "
                  f"torchrun-restart / survive {ratio(measured['torchrun-restart']['lost'], survive)}x, "
                  f"replace / survive {ratio(measured['replace']['lost'], survive)}x."]
    return "\n".join(lines)


def combined(results: list[dict], strategies: list[str]) -> str:
    """One line per strategy: survive against restart, and survive's accuracy against clean."""
    lines = ["| strategy | survive: time lost, median (s) | restart: time lost, median (s) | restart / survive "
             "| accuracy, survive vs clean |",
             "|----------|-------------------------------|--------------------------------|------------------"
             "|----------------------------|"]
    for strategy in strategies:
        m = measure(results, strategy)
        lines.append(f"| {strategy} | {m['survive']['lost']:.1f} | {m['restart']['lost']:.1f} | "
                     f"{ratio(m['restart']['lost'], m['survive']['lost'])} | {m['survive']['vs_clean']:+.4f} |")
    return "\n".join(lines)


def write(out: Path, results: list[dict], strategies: list[str], command: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    tables = combined(results, strategies) + "\n\n" + "\n\n".join(report(results, s) for s in strategies)
    (out / "README.md").write_text("# Time lost per failure: live membership against restarting all\n\n"
                                   f"Made by `{command}` (see its docstring for the set-up).\n\n" + tables + "\n")
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="faulted survive runs per strategy (default 20)")
    parser.add_argument("--replace-runs", type=int, default=10, help="replace runs per strategy (default 10)")
    parser.add_argument("--reference-runs", type=int, default=5,
                        help="clean and restart runs per strategy, torchrun-clean and torchrun-restart runs in all "
                             "(default 5)")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "elastic"))
    args = parser.parse_args()
    for name in ("runs", "replace_runs", "reference_runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more runs")
    command = "python benchmarks/elastic.py " + " ".join(sys.argv[1:])
    counts = {"clean": args.reference_runs, "survive": args.runs, "replace": args.replace_runs,
              "restart": args.reference_runs, "torchrun-clean": args.reference_runs,
              "torchrun-restart": args.reference_runs}
    rounds = max(counts.values())
    rng = random.Random(args.seed)
    plan = []  # (index, strategy or None for the torchrun kinds, kind, rank, step)
    for index in range(rounds):
        for strategy in [*args.strategies, None]:
            rank, step = rng.randint(0, WORKERS - 1), rng.randint(1, EPOCHS * STEPS_PER_EPOCH - 1)
            for kind in KINDS:
                if kind.startswith("torchrun") == (strategy is None) and due(counts[kind], rounds, index):
                    plan.append((index, strategy, kind, rank, step))
    results = []
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for done, (index, strategy, kind, rank, step) in enumerate(plan, 1):
            result = run_once(kind, strategy or "", Path(scratch) / f"{strategy or 'torchrun'}-{kind}-{index}",
                              rank, step)
            result["strategy_run"] = strategy
            results.append(result)
            print(f"[{done}/{len(plan)} {time.perf_counter() - began:.0f}s] {json.dumps(result)}", flush=True)
            if done == len(plan) or plan[done][0] != index:  # a round is over: what it measured, kept
                tables = write(Path(args.out), results, args.strategies, command)
    print(tables)


if __name__ == "__main__":
    main()
