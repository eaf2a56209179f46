"""Time lost per failure: live membership (--min-workers) against restarting every worker (--max-restarts, torchrun).

    python benchmarks/elastic.py          # writes benchmarks/results/elastic/ (README.md, results.json)

Each dptrain run is a real `dptrain train` (digits, 4 workers, 20 epochs of 12 steps, a checkpoint every
epoch) under each of --strategies (default: sync, fedavg, allreduce, streaming, hierarchical with
--ranks-per-node 2, i.e. 2 emulated nodes of 2, and async). In a faulted run one worker (rank 0, 1, 2 or 3:
rank 0 too, since the launcher serves the store; under async, whose rank 0 holds the global model, the others
then take it over) is killed with SIGKILL after a random training step of the whole run
(DPTRAIN_FAULT=step@RANK:STEP, once); the faulted kinds of one strategy and round share that (rank, step).
(Results made before 2026-12-02's async take-over drew rank 1, 2 or 3 only under async, and so other draws.)
--commit-every-steps N adds that flag to allreduce's survive and replace runs (the survivors go on from an in-memory
commit within the epoch; each result keeps continued_from_step, the step of the epoch they went on from), and
--slow-worker RANK:FACTOR to every dptrain run (longer epochs: allreduce's workers all wait for that rank).
An async run that lost rank 0 also keeps takeover_seconds (the stamp of the new rank 0's `took over` line less
the kill time: noticing the loss, while the survivors still train, then regrouping) and took_over_in (the
seconds that line says the regrouping held the survivors up: what they lost).
Kinds of run (--kinds picks some; default all):

- clean: no fault (the reference accuracy); --reference-runs per strategy (default 5);
- survive: --min-workers 3: the survivors leave the failed group, agree on who is left and redo the epoch
  the worker died in; --runs per strategy (default 20);
- replace: --workers 3:4 (torchrun's MIN:MAX): as survive, and the launcher starts a new worker in place
  of the failed one, which joins at an epoch end and heals from rank 0; --replace-runs per strategy
  (default 10; none under async, which refuses --workers MIN:MAX). Each result says whether a worker
  joined (a metrics.jsonl record whose "membership" has "joined"), how long after the kill rank 0 said it
  joined (join_seconds: the stamp of its `rank N joined after epoch E` line less the kill time) and how
  many workers were live at the end (summary.json "workers"). A replacement starts a Python process
  that imports torch and loads the data, seconds of work: give runs long enough for it (--epochs 60, and
  --kill-within 0.5 to kill in the first half of the run only);
- restart: --max-restarts 1: the launcher stops every worker and starts all four again from the last
  complete checkpoint; --reference-runs per strategy;
- torchrun-clean and torchrun-restart: PyTorch's own fault-tolerant recipe, a textbook DDP script that
  saves a snapshot every epoch (benchmarks/baselines/textbook_ddp.py --snapshot) under
  `torchrun --standalone --nproc-per-node 4 --max-restarts 1` (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
  without it the restarted gloo workers of torch 2.13 fail to connect), a random rank killed after a
  random step ("worker failures are handled by restarting all workers"). Not the same training
  (allreduce each step) and strategy-independent: --reference-runs in all, shown in every strategy's
  table; its accuracy is compared with its own clean runs.

--reference-runs 0 leaves out clean, restart and the torchrun kinds (as --kinds survive replace would).

All kinds are interleaved so that load drifts hit all alike: round i runs, for every strategy, each kind
whose runs are spread evenly over the rounds and falls in round i. results.json and README.md are written
again after every round, so a stopped benchmark leaves what it measured.

Time lost is measured inside each faulted run, with no clean reference: every stdout line is stamped
(time.time()) as it arrives, and the epoch boundaries are the lines that end an epoch (dptrain's
`[rankN] epoch E/20  train_loss ...`, printed by the lowest live rank; textbook_ddp's `epoch E/20 done`, printed
by rank 0 after its snapshot). The kill time is the mtime of the marker file made right before the SIGKILL
(DPTRAIN_FAULT_ONCE's file; textbook_ddp's SNAPSHOT.killed). The kill's epoch is (STEP-1)//12+1. Time lost =
the stamp of the first epoch line printed after the kill for that epoch or a later one (the epoch redone by
the survivors, or by the workers restarted from the last checkpoint) - the kill time - the part of that epoch
still to do at the kill, which a run without the failure would have spent too: (steps left in it / 12) x the
run's own median epoch duration (the median gap between consecutive epoch lines, less the gap the kill falls
in). Each faulted result keeps kill_offset and boundary (seconds from the run's start), kill_epoch,
median_epoch_seconds and lost_seconds (None, with lost_reason, when it cannot be measured); wall_seconds is kept
too. The tables give the median and min-max of lost_seconds over the finished runs of each faulted kind
(survive, replace, restart, torchrun-restart), and restart / survive and torchrun-restart / survive from those
medians; clean kinds give accuracy only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WORKERS, EPOCHS = 4, 20
STEPS_PER_EPOCH = 12  # digits: 1437 training rows over 4 workers, batch 32
TEXTBOOK_STEPS_PER_EPOCH = 12  # textbook_ddp's len(loader): DistributedSampler's 360 rows per worker, batch 32
KINDS = ("clean", "survive", "replace", "restart", "torchrun-clean", "torchrun-restart")
FAULTED = ("survive", "replace", "restart", "torchrun-restart")
STRATEGIES = ("sync", "fedavg", "allreduce", "streaming", "hierarchical", "async")
STRATEGY_ARGV = {"hierarchical": ["--ranks-per-node", "2"]}  # 4 workers = 2 emulated nodes of 2
TEXTBOOK = Path(__file__).parent / "baselines" / "textbook_ddp.py"
TIMEOUT = 600  # seconds a run may take before it counts as hung (its process group is killed)


EXTRA: dict[str, list[str]] = {"commit": [], "all": []}  # flags from the command line for the dptrain runs
BOUNDARY = re.compile(r"\bepoch (\d+)/(\d+)(?:\s+train_loss| done\b)")  # dptrain's epoch line, textbook_ddp's
JOINED = re.compile(r"\brank \d+ joined after epoch (\d+)")  # rank 0's line when a replacement entered
TOOK_OVER = re.compile(r"\brank \d+ took over in ([\d.]+) s\b")  # async: the new rank 0's line after rank 0 was lost


def stream(pipe, lines: list, stamps: list | None) -> None:
    """Read `pipe` line by line into `lines`, and (stdout) the time.time() each line was read into `stamps`."""
    for line in iter(pipe.readline, ""):
        if stamps is not None:
            stamps.append(time.time())
        lines.append(line)
    pipe.close()


def time_lost(lines: list[str], stamps: list[float], kill: float | None, step: int, steps_per_epoch: int,
              began: float) -> dict:
    """In-run time lost to the kill at `kill` (time.time()) after training step `step` (1-based over the run).

    The stamp of the first epoch line printed after the kill for the kill's epoch or a later one, less the kill
    time, less the part of that epoch still to do at the kill (at the run's own median epoch duration: the gaps
    between consecutive epoch lines, less the one the kill falls in). Offsets are seconds from `began`."""
    found = {"kill_offset": None, "kill_epoch": None, "boundary": None, "median_epoch_seconds": None,
             "lost_seconds": None, "lost_reason": None}
    if kill is None:
        return {**found, "lost_reason": "no kill marker: the fault did not fire"}
    epoch = (step - 1) // steps_per_epoch + 1
    left = steps_per_epoch - ((step - 1) % steps_per_epoch + 1)  # steps of that epoch still to do at the kill
    found["kill_epoch"], found["kill_offset"] = epoch, kill - began
    boundaries = [(stamp, int(match[1]), line.strip()) for line, stamp in zip(lines, stamps)
                  if (match := BOUNDARY.search(line))]
    after = next((b for b in boundaries if b[0] > kill and b[1] >= epoch), None)
    # epoch durations: gaps between consecutive boundary lines, less the one the kill falls in
    gaps = [b[0] - a[0] for a, b in zip(boundaries, boundaries[1:]) if not a[0] <= kill < b[0]]
    if gaps:
        found["median_epoch_seconds"] = statistics.median(gaps)
    if after is None:
        return {**found, "lost_reason": f"no epoch line for epoch {epoch} or later after the kill"}
    found["boundary"] = {"epoch": after[1], "offset": after[0] - began, "line": after[2]}
    if not gaps:
        return {**found, "lost_reason": "no epoch duration outside the kill's epoch to measure"}
    found["lost_seconds"] = after[0] - kill - left / steps_per_epoch * found["median_epoch_seconds"]
    return found


def run_once(kind: str, strategy: str, out: Path, rank: int, step: int) -> dict:
    faulted = kind not in ("clean", "torchrun-clean")
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # every line out as it is printed: it is stamped on arrival
    if kind.startswith("torchrun"):
        out.mkdir(parents=True)
        torchrun = Path(sys.executable).with_name("torchrun")
        argv = [str(torchrun), "--standalone", "--nproc-per-node", str(WORKERS), "--max-restarts", "1",
                str(TEXTBOOK), "--epochs", str(EPOCHS), "--snapshot", str(out / "snapshot.pt")]
        # torch 2.13's torchrun shares its rendezvous store with the workers, and restarted gloo workers then
        # connect to the first attempt's addresses and fail (pytorch/pytorch#135712, #167288): its workaround.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        marker, steps_per_epoch = out / "snapshot.pt.killed", TEXTBOOK_STEPS_PER_EPOCH
        if faulted:
            env["DPTRAIN_BENCH_KILL"] = f"{rank}:{step}"
    else:
        workers = f"{WORKERS - 1}:{WORKERS}" if kind == "replace" else str(WORKERS)
        argv = [sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--strategy", strategy,
                "--workers", workers, "--epochs", str(EPOCHS), "--lr", "0.05", "--no-progress",
                "--out", str(out), *STRATEGY_ARGV.get(strategy, [])]
        marker, steps_per_epoch = out.parent / f"{out.name}.fired", STEPS_PER_EPOCH
        if faulted:
            env.update(DPTRAIN_FAULT=f"step@{rank}:{step}", DPTRAIN_FAULT_ONCE=str(marker))
        argv += {"clean": [], "survive": ["--min-workers", str(WORKERS - 1)], "replace": [],
                 "restart": ["--max-restarts", "1"]}[kind]
        argv += EXTRA["all"] + (EXTRA["commit"] if strategy == "allreduce" and kind in ("survive", "replace") else [])
    began, began_wall = time.perf_counter(), time.time()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
    out_lines, err_lines, stamps = [], [], []
    readers = [threading.Thread(target=stream, args=(child.stdout, out_lines, stamps), daemon=True),
               threading.Thread(target=stream, args=(child.stderr, err_lines, None), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        code = child.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the launcher and every worker it started
        child.wait()
        code = "hung"
    wall = time.perf_counter() - began
    for reader in readers:
        reader.join(timeout=30)  # a worker left behind holding the pipe must not hold the benchmark
    stdout, stderr = "".join(out_lines), "".join(err_lines)
    joined, steps_from = None, []
    if kind.startswith("torchrun"):
        said = [line for line in stdout.splitlines() if line.startswith("test accuracy ")]
        accuracy, workers = (float(said[-1].split()[-1]) if said else None), WORKERS if said else None
    else:
        summary_path = out / "summary.json"
        summary = json.loads(summary_path.read_text()) if code == 0 and summary_path.exists() else {}
        accuracy, workers = summary.get("test_accuracy"), summary.get("workers")
        metrics = out / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
            if metrics.exists() else []
        if kind == "replace":
            joined = any((record.get("membership") or {}).get("joined") for record in records)
        # allreduce with --commit-every-steps: the step of the epoch the survivors went on from (0: its start)
        steps_from = [record["membership"].get("continued_from_step", 0) for record in records
                      if "membership" in record and not record["membership"].get("joined")]
    result = {"kind": kind, "strategy": "allreduce (torchrun)" if kind.startswith("torchrun") else strategy,
              "rank": rank if faulted else None, "step": step if faulted else None, "exit": code,
              "wall_seconds": wall, "test_accuracy": accuracy, "workers_at_end": workers,
              # dptrain's launcher says it restarts; torchrun logs that at INFO (not shown), but a worker's failure
              # ("failed (exitcode: -9)") at ERROR, and with --max-restarts 1 the worker group is then restarted
              "restarted": "restarting the" in stderr or "Restarting" in stderr
                           or (kind.startswith("torchrun") and "failed (exitcode:" in stderr),
              "continued": "continuing from epoch" in stdout + stderr}
    if faulted:
        kill = marker.stat().st_mtime if marker.exists() else None  # created right before the SIGKILL
        result.update(time_lost(out_lines, stamps, kill, step, steps_per_epoch, began_wall))
    if kind in ("survive", "replace"):
        result["continued_from_step"] = steps_from[0] if steps_from else None
    if faulted and strategy == "async" and rank == 0:
        took = next(((stamp, float(match[1])) for line, stamp in zip(out_lines, stamps)
                     if (match := TOOK_OVER.search(line))), None)
        result["takeover_seconds"] = took[0] - kill if took is not None and kill is not None else None
        result["took_over_in"] = took[1] if took is not None else None
    if kind == "replace":
        result["joined"] = joined
        entered = next((stamp for line, stamp in zip(out_lines, stamps) if JOINED.search(line)), None)
        result["join_seconds"] = entered - kill if entered is not None and kill is not None else None
    if code != 0 or accuracy is None:
        result["stdout_tail"], result["stderr_tail"] = stdout[-2000:], stderr[-4000:]
    return result


def due(count: int, rounds: int, index: int) -> bool:
    """Whether round `index` of `rounds` holds one of `count` runs spread evenly over them (round 0 holds one)."""
    return math.ceil((index + 1) * count / rounds) > math.ceil(index * count / rounds)


def median(values: list) -> float:
    return statistics.median(values) if values else float("nan")


def measure(results: list[dict], strategy: str) -> dict:
    """Per kind: runs, finished runs, in-run time lost (median, min, max; faulted kinds), accuracy median and vs
    its clean runs."""
    results = [r for r in results if r["strategy_run"] in (strategy, None)]
    finished = {kind: [r for r in results if r["kind"] == kind and r["exit"] == 0 and r["test_accuracy"] is not None]
                for kind in KINDS}
    measured = {}
    for kind in KINDS:
        clean_kind = "torchrun-clean" if kind.startswith("torchrun") else "clean"
        clean_accuracy = median([r["test_accuracy"] for r in finished[clean_kind]])
        losses = [r["lost_seconds"] for r in finished[kind] if r.get("lost_seconds") is not None]
        accuracy = median([r["test_accuracy"] for r in finished[kind]])
        measured[kind] = {"runs": [r for r in results if r["kind"] == kind], "finished": len(finished[kind]),
                          "measured": len(losses) if kind in FAULTED else None, "lost": median(losses),
                          "spread": (min(losses), max(losses)) if losses else None,
                          "accuracy": accuracy, "vs_clean": accuracy - clean_accuracy}
    return measured


def number(value, form: str) -> str:
    return "–" if value is None or math.isnan(value) else format(value, form)


def ratio(slow: float, fast: float) -> str:
    return f"{slow / fast:.1f}" if fast > 0 and not math.isnan(slow) else "–"


def report(results: list[dict], strategy: str, kinds: list[str]) -> str:
    """The table of one strategy's runs (the torchrun runs, made alongside every strategy's, are in each)."""
    measured = measure(results, strategy)
    lines = [f"### {strategy}", "",
             "| run | n | exit 0 | time lost measured | time lost, median (s) | min–max (s) | test accuracy, median "
             "| vs its clean runs |",
             "|-----|---|--------|--------------------|-----------------------|-------------|-----------------------"
             "|-------------------|"]
    for kind in kinds:
        m = measured[kind]
        spread = f"{m['spread'][0]:.1f}–{m['spread'][1]:.1f}" if m["spread"] else "–"
        lines.append(f"| {kind} | {len(m['runs'])} | {m['finished']} | {number(m['measured'], 'd')} | "
                     f"{number(m['lost'], '.1f')} | {spread} | {number(m['accuracy'], '.4f')} | "
                     f"{number(m['vs_clean'], '+.4f')} |")
    replaced = measured["replace"]["runs"]
    survive = measured["survive"]["lost"]
    if replaced:
        full = sum(r["workers_at_end"] == WORKERS for r in replaced)
        joined = sum(bool(r.get("joined")) for r in replaced)
        waits = [r["join_seconds"] for r in replaced if r.get("join_seconds") is not None]
        lines += ["", f"replace: {full} of {len(replaced)} runs ended with {WORKERS} workers; a worker joined in "
                      f"{joined}" + (f", {number(median(waits), '.1f')} s after the kill (median; "
                                     f"{min(waits):.1f}–{max(waits):.1f} s)." if waits else ".")]
    elif strategy == "async" and "replace" in kinds:
        lines += ["", "replace: not run (async refuses --workers MIN:MAX)."]
    taken = [r for r in measured["survive"]["runs"] if r.get("rank") == 0]
    if strategy == "async" and taken:
        held = [r["took_over_in"] for r in taken if r.get("took_over_in") is not None]
        noticed = [r["takeover_seconds"] for r in taken if r.get("takeover_seconds") is not None]
        lines += ["", f"survive with rank 0 killed: {len(taken)} runs, {sum(r['exit'] == 0 for r in taken)} exited 0; "
                      f"the others took over in {len(held)}"
                      + (f", {number(median(noticed), '.1f')} s after the kill (median; {min(noticed):.1f}–"
                         f"{max(noticed):.1f} s), regrouping held them up {number(median(held), '.1f')} s "
                         f"(median; {min(held):.1f}–{max(held):.1f} s)." if held and noticed else ".")]
    lines += ["", f"Time lost against survive: restart / survive {ratio(measured['restart']['lost'], survive)}x, "
                  f"torchrun-restart / survive {ratio(measured['torchrun-restart']['lost'], survive)}x, "
                  f"replace / survive {ratio(measured['replace']['lost'], survive)}x."]
    return "\n".join(lines)


def combined(results: list[dict], strategies: list[str]) -> str:
    """One line per strategy: survive against restart and torchrun-restart, and survive's accuracy against clean."""
    lines = ["| strategy | survive: time lost, median (s) | restart: time lost, median (s) | restart / survive "
             "| torchrun-restart / survive | accuracy, survive vs clean |",
             "|----------|-------------------------------|--------------------------------|------------------"
             "|----------------------------|----------------------------|"]
    for strategy in strategies:
        m = measure(results, strategy)
        survive = m["survive"]["lost"]
        lines.append(f"| {strategy} | {number(survive, '.1f')} | {number(m['restart']['lost'], '.1f')} | "
                     f"{ratio(m['restart']['lost'], survive)} | {ratio(m['torchrun-restart']['lost'], survive)} | "
                     f"{number(m['survive']['vs_clean'], '+.4f')} |")
    return "\n".join(lines)


def write(out: Path, results: list[dict], strategies: list[str], kinds: list[str], command: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    tables = combined(results, strategies) + "\n\n" + "\n\n".join(report(results, s, kinds) for s in strategies)
    (out / "README.md").write_text("# Time lost per failure: live membership against restarting all\n\n"
                                   f"Made by `{command}` (see its docstring for the set-up).\n\n" + tables + "\n")
    return tables


def main() -> None:
    global EPOCHS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="faulted survive runs per strategy (default 20)")
    parser.add_argument("--replace-runs", type=int, default=10, help="replace runs per strategy (default 10)")
    parser.add_argument("--reference-runs", type=int, default=5,
                        help="clean and restart runs per strategy, torchrun-clean and torchrun-restart runs in all "
                             "(default 5)")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                        help="kinds of run to make (default all); the others are not run")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=f"epochs of every run (default {EPOCHS})")
    parser.add_argument("--kill-within", type=float, default=1.0, metavar="FRACTION",
                        help="kill after a step drawn from this first part of the run only (default 1: all of it)")
    parser.add_argument("--kill-ranks", type=int, nargs="+", default=None, metavar="RANK",
                        help="draw the killed worker among these ranks only (default: any of the 4)")
    parser.add_argument("--commit-every-steps", type=int, default=None, metavar="N",
                        help="allreduce's survive runs go on from an in-memory commit every N steps (default: from "
                             "the epoch's start)")
    parser.add_argument("--slow-worker", default=None, metavar="RANK:FACTOR",
                        help="every dptrain run makes that rank's steps FACTOR times slower (longer epochs; under "
                             "allreduce every rank waits for it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "elastic"))
    args = parser.parse_args()
    if args.epochs < 2 or not 0 < args.kill_within <= 1:
        parser.error(f"--epochs {args.epochs} must be 2 or more and --kill-within {args.kill_within:g} in (0, 1]")
    if args.kill_ranks is not None and not set(args.kill_ranks) <= set(range(WORKERS)):
        parser.error(f"--kill-ranks {' '.join(map(str, args.kill_ranks))}: the ranks are 0 to {WORKERS - 1}")
    EPOCHS = args.epochs
    EXTRA["commit"] = ["--commit-every-steps", str(args.commit_every_steps)] if args.commit_every_steps else []
    EXTRA["all"] = ["--slow-worker", args.slow_worker] if args.slow_worker else []
    kinds = [kind for kind in KINDS if kind in args.kinds]
    counts = {"clean": args.reference_runs, "survive": args.runs, "replace": args.replace_runs,
              "restart": args.reference_runs, "torchrun-clean": args.reference_runs,
              "torchrun-restart": args.reference_runs}
    counts = {kind: count if kind in kinds else 0 for kind, count in counts.items()}
    if min(args.runs, args.replace_runs, args.reference_runs) < 0:
        parser.error("--runs, --replace-runs and --reference-runs count runs: give 0 or more")
    rounds = max(counts.values())
    rng = random.Random(args.seed)
    plan = []  # (index, strategy or None for the torchrun kinds, kind, rank, step)
    for index in range(rounds):
        for strategy in [*args.strategies, None]:
            rank = rng.choice(args.kill_ranks) if args.kill_ranks else rng.randint(0, WORKERS - 1)
            step = rng.randint(1, max(1, int(args.kill_within * EPOCHS * STEPS_PER_EPOCH) - 1))
            for kind in KINDS:
                if strategy == "async" and kind == "replace":
                    continue  # async refuses --workers MIN:MAX
                if kind.startswith("torchrun") == (strategy is None) and due(counts[kind], rounds, index):
                    plan.append((index, strategy, kind, rank, step))
    if not plan:
        parser.error(f"nothing to run: --kinds {' '.join(kinds)} with --runs {args.runs}, --replace-runs "
                     f"{args.replace_runs}, --reference-runs {args.reference_runs} and --strategies "
                     f"{' '.join(args.strategies)} make no run")
    command = "python benchmarks/elastic.py " + " ".join(sys.argv[1:])
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
                tables = write(Path(args.out), results, args.strategies, kinds, command)
    print(tables)


if __name__ == "__main__":
    main()
