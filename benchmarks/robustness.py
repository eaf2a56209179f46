"""Robustness benchmark (issue 20): 12 small problems a user could have written, each trained at equal
epochs by one worker and by sync (2, 4, 8 workers), async (2, 4) and fedavg over iid partitions (2, 4),
over several seeds, under several `--lr-scaling` rules.

The problems (data factory, model factory, flags) are in benchmarks/robustness_problems.py, split
once into a tuning half and a held-out half. A run is (problem, configuration, workers, rule, seed,
epochs); its directory is RUNS/<problem>/<E>ep/<config>-w<W>/<rule>/seed<S> (rule `any` for the
one-worker runs, which no rule changes). Runs of one (strategy, workers) are trained by one group of
W processes (`dptrain run --workers W benchmarks/robustness_worker.py JOBS.json`) that joins its
process group once and trains the runs in turn, as `dptrain train` would each: starting torch costs
more than a small run's training. A run whose directory holds summary.json is not run again (nor one
that diverged, a result too); an unfinished directory is deleted and run again, so the command can be
stopped and restarted at any time.

    python benchmarks/robustness.py run --half tuning --rules none,linear-warm --seeds 0,1,2
    python benchmarks/robustness.py run --half tuning --lr-study 0.05,0.02,0.01   # one worker, explicit --lr
    python benchmarks/robustness.py run --only blobs-mlp --configs one-worker,sync --workers 2 --seeds 0
    python benchmarks/robustness.py report     # OUT/results.json and OUT/<half>.md from the finished runs
    python benchmarks/robustness.py list       # problems, configurations, rules

Scores, in points: test accuracy x 100 for classification; R² x 100 = 100 (1 - test MSE / var(test
targets)) for regression.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS_FILE = ROOT / "benchmarks" / "robustness_problems.py"
WORKER = ROOT / "benchmarks" / "robustness_worker.py"
RUNS = ROOT / "runs" / "robustness"
OUT = ROOT / "benchmarks" / "results" / "robustness"

sys.path.insert(0, str(PROBLEMS_FILE.parent))
from robustness_problems import HELD_OUT, PROBLEMS, TUNING, half_of  # noqa: E402
from robustness_worker import FAILED  # noqa: E402

# Configuration: (strategy, worker counts, its own flags, one line of help).
CONFIGS: dict[str, tuple[str, tuple[int, ...], tuple[str, ...], str]] = {
    "one-worker": ("allreduce", (1,), (), "one worker, the reference (no rule changes it)"),
    "sync": ("sync", (2, 4, 8), (), "sync, average every epoch"),
    "async": ("async", (2, 4), (), "async, merge every epoch"),
    "fedavg": ("fedavg", (2, 4), ("--partition", "iid"), "fedavg over iid partitions, one local epoch a round"),
}
LR_STUDY = "one-worker-lr"  # + the learning rate: one worker with an explicit --lr


def rule_flags(rule: str, epochs: int) -> list[str]:
    """The flags a rule appends to a multi-worker run."""
    if rule == "none":
        return ["--lr-scaling", "none"]
    if rule == "linear-warm":  # the behaviour of the previous default: LR x W, warm-up over a tenth, at most 5
        return ["--lr-scaling", "linear", "--warmup-epochs", f"{min(5.0, epochs / 10):g}"]
    if rule == "auto":
        return ["--lr-scaling", "auto"]
    raise ValueError(f"unknown rule {rule!r}")


RULES = {"none": "--lr-scaling none (keep --lr)",
         "linear-warm": "--lr-scaling linear --warmup-epochs min(5, epochs/10) (the previous default)",
         "auto": "--lr-scaling auto (today's default)"}

# (strategy, workers): the most a cell's mean paired difference to one worker may lose, in points.
GOALS = {("sync", 2): 1.0, ("sync", 4): 2.0, ("async", 2): 2.0, ("fedavg", 2): 2.0}
WITHOUT_GOAL = [("sync", 8), ("async", 4), ("fedavg", 4)]
ROW_ORDER = [("one-worker", 1), ("sync", 2), ("sync", 4), ("sync", 8), ("async", 2), ("async", 4),
             ("fedavg", 2), ("fedavg", 4)]


# ---------------------------------------------------------------------------------------------------
# Runs

@dataclass(frozen=True)
class Job:
    problem: str
    config: str  # one-worker, one-worker-lrX, sync, async, fedavg
    workers: int
    rule: str  # "any" for one-worker configurations
    seed: int
    epochs: int

    @property
    def strategy(self) -> str:
        return "allreduce" if self.config.startswith("one-worker") else CONFIGS[self.config][0]

    @property
    def id(self) -> str:
        return f"{self.problem}/{self.epochs}ep/{self.config}-w{self.workers}/{self.rule}/seed{self.seed}"

    def run_dir(self, runs: Path) -> Path:
        return runs / self.id

    def argv(self, runs: Path) -> list[str]:
        """The `dptrain train` flags of this run."""
        problem = PROBLEMS[self.problem]
        flags = ["--data", f"{PROBLEMS_FILE}:{problem.data}", "--model", f"{PROBLEMS_FILE}:{problem.model}",
                 *problem.flags, "--epochs", str(self.epochs), "--strategy", self.strategy,
                 "--workers", str(self.workers)]
        if self.config.startswith("one-worker"):
            flags += ["--lr-scaling", "none"]
            if self.config.startswith(LR_STUDY):
                flags += ["--lr", self.config.removeprefix(LR_STUDY)]
        else:
            flags += [*CONFIGS[self.config][2], *rule_flags(self.rule, self.epochs)]
        return flags + ["--seed", str(self.seed), "--device", "cpu", "--no-progress", "--checkpoint-every", "0",
                        "--timeout", "120", "--out", str(self.run_dir(runs))]


def parse_run_dir(path: Path, runs: Path) -> Job:
    """The Job of a run directory RUNS/<problem>/<E>ep/<config>-w<W>/<rule>/seed<S>."""
    problem, epochs, config_workers, rule, seed = path.relative_to(runs).parts
    config, _, workers = config_workers.rpartition("-w")
    return Job(problem, config, int(workers), rule, int(seed.removeprefix("seed")), int(epochs.removesuffix("ep")))


def select_jobs(problems: list[str], configs: list[str], worker_counts: list[int], rules: list[str],
                seeds: list[int], lr_study: list[str], epochs: Optional[int] = None) -> list[Job]:
    """Every run asked for, seed-major (all of seed 0 comes before any of seed 1); `epochs` replaces the
    problems' own (for quick checks: the epochs are part of a run's identity)."""
    jobs = []
    for seed in seeds:
        for name in problems:
            epochs_of = epochs or PROBLEMS[name].epochs
            for config in configs:
                _, counts, _, _ = CONFIGS[config]
                if config == "one-worker":
                    jobs.append(Job(name, config, 1, "any", seed, epochs_of))
                    continue
                for workers in counts:
                    if workers in worker_counts:
                        jobs += [Job(name, config, workers, rule, seed, epochs_of) for rule in rules]
            if "--lr" not in PROBLEMS[name].flags:  # the study varies only the default --lr
                jobs += [Job(name, f"{LR_STUDY}{lr}", 1, "any", seed, epochs_of) for lr in lr_study]
    return jobs


def group_jobs(jobs: list[Job]) -> dict[tuple[str, int], list[Job]]:
    """Jobs by (strategy, workers): one group of processes each, fewest workers first."""
    groups: dict[tuple[str, int], list[Job]] = {}
    for job in jobs:
        groups.setdefault((job.strategy, job.workers), []).append(job)
    order = ["allreduce", "sync", "async", "fedavg"]
    return dict(sorted(groups.items(), key=lambda item: (item[0][1], order.index(item[0][0]))))


def finished(job: Job, runs: Path) -> bool:
    """Whether the run has its result: a summary, or a recorded divergence (which a rerun would repeat)."""
    out = job.run_dir(runs)
    if (out / "summary.json").is_file():
        return True
    failure = out / "failed.json"
    return failure.is_file() and json.loads(failure.read_text()).get("final", False)


def run_group(key: tuple[str, int], jobs: list[Job], runs: Path, progress) -> dict:
    """Train `jobs` (one strategy and worker count) in one group of processes, starting it again after a
    failed run with the runs after it; returns {jobs, finished, failed, seconds, starts}."""
    strategy, workers = key
    logs = runs / "_groups"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    pending = [job for job in jobs if not finished(job, runs)]
    started, starts, failed, fruitless = time.monotonic(), 0, [], 0
    source = source_version()  # what the ranks import
    while pending:
        for job in pending:  # an unfinished directory is run again from scratch
            if job.run_dir(runs).exists():
                shutil.rmtree(job.run_dir(runs))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        jobs_file, log_file = logs / f"{strategy}-w{workers}-{stamp}.json", logs / f"{strategy}-w{workers}-{stamp}.log"
        jobs_file.write_text(json.dumps([{"id": job.id, "argv": job.argv(runs)} for job in pending], indent=1))
        command = [sys.executable, "-m", "dptrain", "run", "--workers", str(workers), str(WORKER), str(jobs_file)]
        starts += 1
        with open(log_file, "w") as log:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            done_before = 0
            while process.poll() is None:
                time.sleep(1.0)
                done_now = sum(finished(job, runs) for job in pending)
                progress.update(done_now - done_before)
                done_before = done_now
        done_now = sum(finished(job, runs) for job in pending)
        progress.update(done_now - done_before)
        remaining = [job for job in pending if not finished(job, runs)]
        if process.returncode == 0 and not remaining:
            break
        broken = failed_job(log_file, remaining)
        if broken is None:  # no run named as failing: the group itself did not start or was stopped
            fruitless = fruitless + 1 if len(remaining) == len(pending) else 0
            progress.write(f"group {strategy} W={workers}: exit code {process.returncode} with no failed run "
                           f"named; see {log_file}")
            if fruitless >= 2:
                progress.write(f"group {strategy} W={workers}: giving up on its {len(remaining)} remaining runs")
                break
            pending = remaining
            continue
        job, failure = broken
        failure["final"] = failure.get("type") == "Diverged"  # a rerun would diverge again
        failure["log"] = str(log_file)
        job.run_dir(runs).mkdir(parents=True, exist_ok=True)
        (job.run_dir(runs) / "failed.json").write_text(json.dumps(failure, indent=1))
        progress.write(f"FAILED {job.id}: {failure.get('type')}: {failure.get('error')} (log: {log_file})")
        failed.append(job.id)
        if failure["final"]:
            progress.update(1)
        pending = [other for other in remaining if other != job]
    seconds = time.monotonic() - started
    record = {"group": f"{strategy}-w{workers}", "jobs": len(jobs), "finished": sum(finished(j, runs) for j in jobs),
              "failed": failed, "starts": starts, "seconds": round(seconds, 1),
              "at": time.strftime("%Y-%m-%d %H:%M:%S"), "source": source}
    with open(runs / "groups.jsonl", "a") as handle:
        handle.write(json.dumps(record) + "\n")
    return record


def source_version() -> dict:
    """The dptrain code the group trained with: the commit, and a digest of src/ as it was (it may hold
    uncommitted changes, which config.yaml does not show)."""
    digest = hashlib.sha1()
    for path in sorted((ROOT / "src" / "dptrain").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", None
    return {"commit": commit, "src_modified": dirty, "src_sha1": digest.hexdigest()[:12]}


def failed_job(log_file: Path, remaining: list[Job]) -> Optional[tuple[Job, dict]]:
    """The run a failed group broke on, and why, from the ranks' ROBUSTNESS-FAILED lines: the first failure
    that is not another rank's reaction to it (a peer failure)."""
    by_id = {job.id: job for job in remaining}
    failures = []
    for line in log_file.read_text(errors="replace").splitlines():
        at = line.find(FAILED)
        if at >= 0:
            try:
                failures.append(json.loads(line[at + len(FAILED):]))
            except json.JSONDecodeError:
                continue
    failures = [f for f in failures if f.get("id") in by_id]
    if not failures:
        return None
    cause = next((f for f in failures if f.get("type") != "PeerFailure"), failures[0])
    return by_id[cause["id"]], cause


def run(args: argparse.Namespace) -> int:
    problems = select_problems(args.half, args.only)
    lr_study = [lr for lr in args.lr_study.split(",") if lr] if args.lr_study else []
    default_configs = "" if lr_study else ",".join(CONFIGS)
    configs = [c for c in (args.configs if args.configs is not None else default_configs).split(",") if c]
    rules = [r for r in args.rules.split(",") if r]
    for name, valid, given in (("configuration", CONFIGS, configs), ("rule", RULES, rules)):
        unknown = [value for value in given if value not in valid]
        if unknown:
            raise SystemExit(f"unknown {name} {unknown[0]!r}; valid: {', '.join(valid)}")
    jobs = select_jobs(problems, configs, [int(w) for w in args.workers.split(",")], rules,
                       [int(s) for s in args.seeds.split(",")], lr_study, args.epochs)
    runs = Path(args.runs)
    groups = group_jobs(jobs)
    pending = {key: [job for job in members if not finished(job, runs)] for key, members in groups.items()}
    print(f"{len(jobs)} runs asked for, {sum(map(len, pending.values()))} to train, in "
          f"{sum(1 for p in pending.values() if p)} groups", flush=True)
    if args.dry_run:
        for (strategy, workers), members in pending.items():
            for job in members:
                print(f"{strategy} W={workers}: dptrain train {' '.join(job.argv(runs))}")
        return 0
    from tqdm import tqdm

    started = time.monotonic()
    with tqdm(total=sum(map(len, pending.values())), unit="run", dynamic_ncols=True,
              mininterval=1.0 if sys.stderr.isatty() else 30.0) as progress:
        for (strategy, workers), members in pending.items():
            if not members:
                continue
            record = run_group((strategy, workers), members, runs, progress)
            progress.write(f"[{time.strftime('%H:%M:%S')}] group {strategy} W={workers}: {record['finished']} of "
                           f"{record['jobs']} runs finished in {record['seconds']:.1f} s "
                           f"({record['seconds'] / max(record['jobs'], 1):.1f} s a run, {record['starts']} start(s))"
                           + (f", failed: {', '.join(record['failed'])}" if record["failed"] else ""))
            report(runs, Path(args.out), quiet=True)
    print(f"done in {time.monotonic() - started:.0f} s; tables in {args.out}", flush=True)
    report(runs, Path(args.out))
    return 0


def select_problems(half: str, only: Optional[str]) -> list[str]:
    problems = {"tuning": TUNING, "held-out": HELD_OUT, "all": TUNING + HELD_OUT}[half]
    if only:
        wanted = only.split(",")
        unknown = [name for name in wanted if name not in PROBLEMS]
        if unknown:
            raise SystemExit(f"unknown problem {unknown[0]!r}; valid: {', '.join(PROBLEMS)}")
        problems = [name for name in problems if name in wanted]
    return problems


# ---------------------------------------------------------------------------------------------------
# Collecting finished runs

def score_of(task: str, accuracy: Optional[float], loss: Optional[float], variance: float) -> Optional[float]:
    """Points: accuracy x 100, or R² x 100 for regression."""
    if task == "classify":
        return None if accuracy is None else 100.0 * accuracy
    return None if loss is None else 100.0 * (1.0 - loss / variance)


def _variances() -> dict[str, float]:
    from robustness_problems import target_variance

    return {name: target_variance(name) for name, problem in PROBLEMS.items() if problem.task == "regress"}


def collect(runs: Path, variances: dict[str, float]) -> list[dict]:
    """One record per finished (or diverged) run under `runs`."""
    records = []
    for path in sorted(runs.glob("*/*ep/*-w*/*/seed*")):
        summary_file, failure_file = path / "summary.json", path / "failed.json"
        diverged = failure_file.is_file() and json.loads(failure_file.read_text()).get("final", False)
        if not summary_file.is_file() and not diverged:  # unfinished, or failed otherwise: run again next time
            continue
        job = parse_run_dir(path, runs)
        if job.problem not in PROBLEMS:
            continue
        task = PROBLEMS[job.problem].task
        variance = variances.get(job.problem, 1.0)
        record = {"problem": job.problem, "half": half_of(job.problem), "config": job.config,
                  "strategy": job.strategy, "workers": job.workers, "rule": job.rule, "seed": job.seed,
                  "epochs": job.epochs, "task": task}
        config = _read_yaml(path / "config.yaml")
        epochs = [json.loads(line) for line in _lines(path / "metrics.jsonl")]
        record["lr"] = config.get("lr")  # --lr as given (or the default)
        record["lr_applied"] = max((e["lr"] for e in epochs if e.get("lr") is not None), default=None)  # scaled
        record["train_loss"] = epochs[-1]["train_loss"] if epochs else None
        record["curve"] = [[e["epoch"], score_of(task, e.get("test_accuracy"), e.get("test_loss"), variance)]
                           for e in epochs if e.get("evaluated", True) and e.get("test_loss") is not None]
        if summary_file.is_file():
            summary = json.loads(summary_file.read_text())
            record.update(score=score_of(task, summary.get("test_accuracy"), summary.get("test_loss"), variance),
                          test_accuracy=summary.get("test_accuracy"), test_loss=summary.get("test_loss"),
                          wall_seconds=summary.get("wall_seconds"))
        else:
            failure = json.loads(failure_file.read_text())
            record.update(score=None, test_accuracy=None, test_loss=None, wall_seconds=None,
                          failed=f"{failure.get('type')}: {failure.get('error')}")
        records.append(record)
    return records


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        return {}
    import yaml

    return yaml.safe_load(path.read_text()) or {}


# ---------------------------------------------------------------------------------------------------
# Statistics and tables

def scores_by_seed(records: list[dict]) -> dict[tuple, dict[int, Optional[float]]]:
    """{(problem, epochs, config, workers, rule): {seed: score, None when the run diverged}}."""
    cells: dict[tuple, dict[int, Optional[float]]] = {}
    for r in records:
        key = (r["problem"], r["epochs"], r["config"], r["workers"], r["rule"])
        cells.setdefault(key, {})[r["seed"]] = r["score"]
    return cells


def mean_std(values: list[float]) -> tuple[Optional[float], Optional[float]]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired(scores: dict[int, Optional[float]], reference: dict[int, Optional[float]]) -> dict:
    """Mean and std over the seeds both have finished of (score - reference score), in points."""
    common = sorted(seed for seed in scores if scores[seed] is not None and reference.get(seed) is not None)
    diffs = [scores[seed] - reference[seed] for seed in common]
    mean, std = mean_std(diffs)
    return {"mean": mean, "std": std, "n": len(diffs), "diffs": diffs}


def fmt(mean: Optional[float], std: Optional[float], sign: bool = False) -> str:
    if mean is None:
        return "—"
    return f"{mean:+.1f} ± {std:.1f}" if sign else f"{mean:.1f} ± {std:.1f}"


def score_cell(scores: dict[int, Optional[float]], seeds: int) -> str:
    """`mean ± std`, with the number of seeds when some are missing, and diverged runs counted."""
    done = [s for s in scores.values() if s is not None]
    text = fmt(*mean_std(done))
    if len(done) != seeds:
        text += f" (n={len(done)})"
    failed = sum(s is None for s in scores.values())
    return text + (f" [{failed} diverged]" if failed else "")


def rules_present(records: list[dict]) -> list[str]:
    present = {r["rule"] for r in records if r["rule"] != "any"}
    return [rule for rule in RULES if rule in present]


def benches(records: list[dict], problems: list[str]) -> list[tuple[str, int]]:
    """The (problem, epochs) pairs with runs, in the problems' order; a problem's own epochs first."""
    pairs = {(r["problem"], r["epochs"]) for r in records}
    return sorted(pairs, key=lambda pair: (problems.index(pair[0]), pair[1] != PROBLEMS[pair[0]].epochs, pair[1]))


def problem_table(bench: tuple[str, int], cells: dict, rules: list[str], seeds: int) -> str:
    """Rows: configuration x W; per rule: score, paired difference to one worker, and to `none`."""
    problem, epochs = bench
    spec = PROBLEMS[problem]
    reference = cells.get((*bench, "one-worker", 1, "any"), {})
    rows = [(config, workers) for config, workers in ROW_ORDER[1:]
            if any((*bench, config, workers, rule) in cells for rule in rules)]
    if not reference and not rows:
        return ""
    header = ["configuration", "W"]
    for rule in rules:
        header += [f"{rule}", f"{rule}: Δ 1 worker"] + ([f"{rule}: Δ none"] if rule != "none" else [])
    lines = [f"### {problem}" + ("" if epochs == spec.epochs else f", {epochs} epochs (not its own {spec.epochs})"),
             "", f"{spec.description}; {epochs} epochs; flags: `{' '.join(spec.flags) or '(none)'}`; score: "
             f"{'accuracy' if spec.task == 'classify' else 'R²'} (points)",
             "", "| " + " | ".join(header) + " |", "|---|---:|" + "---:|" * (len(header) - 2)]
    if reference:
        row = ["one-worker", "1"]
        for rule in rules:  # the same runs under every rule: no rule changes one worker
            row += [score_cell(reference, seeds), ""] + ([""] if rule != "none" else [])
        lines.append("| " + " | ".join(row) + " |")
    for config, workers in rows:
        row = [config, str(workers)]
        for rule in rules:
            scores = cells.get((*bench, config, workers, rule), {})
            row.append(score_cell(scores, seeds) if scores else "")
            d = paired(scores, reference)
            row.append(fmt(d["mean"], d["std"], sign=True) if scores else "")
            if rule != "none":
                d = paired(scores, cells.get((*bench, config, workers, "none"), {}))
                row.append(fmt(d["mean"], d["std"], sign=True) if scores else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def goal_cells(cells: dict, bench_list: list[tuple[str, int]], rule: str) -> list[dict]:
    """Every (problem, strategy, W) cell of `rule` with its paired difference to one worker and its goal."""
    rows = []
    for bench in bench_list:
        reference = cells.get((*bench, "one-worker", 1, "any"), {})
        for key in list(GOALS) + WITHOUT_GOAL:
            scores = cells.get((*bench, key[0], key[1], rule))
            if not scores:
                continue
            d = paired(scores, reference)
            goal = GOALS.get(key)
            failed = sum(s is None for s in scores.values())
            if d["n"] == 0 and not failed:  # nothing to compare with (no one-worker run of these seeds)
                continue
            met = None if goal is None else (d["mean"] is not None and not failed and d["mean"] >= -goal)
            rows.append({"problem": bench[0], "epochs": bench[1], "config": key[0], "workers": key[1], "rule": rule,
                         "goal": goal, "paired": d["mean"], "std": d["std"], "n": d["n"], "failed": failed,
                         "met": met})
    return rows


def summary_tables(cells: dict, bench_list: list[tuple[str, int]], rules: list[str]) -> str:
    """Per rule, the cells meeting the goal and the worst paired difference, overall and per (strategy, W)."""
    lines = ["## Summary", "",
             "Goal: the mean paired difference to one worker over common seeds is at least −1 point for sync at "
             "W=2, −2 for sync at W=4, −2 for async and fedavg at W=2, with no run diverged. "
             "sync W=8, async W=4 and fedavg W=4 are reported without a goal.", "",
             "| rule | cells meeting the goal | worst paired Δ (goal cells) | worst paired Δ (all cells) |",
             "|---|---:|---:|---:|"]
    detail = ["", "| rule | strategy | W | goal | met | mean paired Δ over problems | worst paired Δ "
                  "| diverged runs |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for rule in rules:
        rows = goal_cells(cells, bench_list, rule)
        if not rows:
            continue
        with_goal = [r for r in rows if r["goal"] is not None]
        lines.append(f"| {rule} | {sum(bool(r['met']) for r in with_goal)} / {len(with_goal)} | "
                     f"{worst(with_goal)} | {worst(rows)} |")
        for key in list(GOALS) + WITHOUT_GOAL:
            mine = [r for r in rows if (r["config"], r["workers"]) == key]
            if not mine:
                continue
            diffs = [r["paired"] for r in mine if r["paired"] is not None]
            met = f"{sum(bool(r['met']) for r in mine)} / {len(mine)}" if key in GOALS else "—"
            detail.append(f"| {rule} | {key[0]} | {key[1]} | {f'−{GOALS[key]:g}' if key in GOALS else '—'} | "
                          f"{met} | {f'{statistics.fmean(diffs):+.1f}' if diffs else '—'} | {worst(mine)} | "
                          f"{sum(r['failed'] for r in mine)} |")
    return "\n".join(lines + detail) + "\n"


def worst(rows: list[dict]) -> str:
    """The lowest paired difference and where it is; cells with a diverged run count as worst."""
    diverged = [r for r in rows if r["failed"]]
    if diverged:
        first = diverged[0]
        more = f", and {len(diverged) - 1} more" if len(diverged) > 1 else ""
        return f"diverged ({first['problem']}, {first['config']} W={first['workers']}{more})"
    scored = [r for r in rows if r["paired"] is not None]
    if not scored:
        return "—"
    low = min(scored, key=lambda row: row["paired"])
    return f"{low['paired']:+.1f} ({low['problem']}, {low['config']} W={low['workers']})"


def lr_study_table(records: list[dict], bench_list: list[tuple[str, int]]) -> str:
    """One worker at its default learning rate and at each studied --lr: mean ± std (min) over seeds."""
    studied = sorted({r["config"].removeprefix(LR_STUDY) for r in records if r["config"].startswith(LR_STUDY)},
                     key=float, reverse=True)
    if not studied:
        return ""
    cells = scores_by_seed(records)
    header = ["problem", "default"] + [f"--lr {lr}" for lr in studied]
    lines = ["## One worker at other learning rates", "",
             "Score in points, mean ± std (min) over seeds; default: the problem's own flags, at the --lr that "
             "dptrain chose for them (recorded in each run's config.yaml).", "",
             "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for problem, epochs in bench_list:
        if "--lr" in PROBLEMS[problem].flags:
            continue
        row = [problem + ("" if epochs == PROBLEMS[problem].epochs else f" ({epochs} epochs)")]
        for config in ["one-worker"] + [f"{LR_STUDY}{lr}" for lr in studied]:
            runs = cells.get((problem, epochs, config, 1, "any"), {})
            scores = [s for s in runs.values() if s is not None]
            failed = len(runs) - len(scores)
            mean, std = mean_std(scores)
            text = "—" if mean is None else f"{mean:.1f} ± {std:.1f} ({min(scores):.1f})"
            if config == "one-worker" and mean is not None:
                lrs = sorted({r["lr"] for r in records if (r["problem"], r["epochs"], r["config"]) ==
                              (problem, epochs, config) and r.get("lr") is not None})
                text += f" at lr {', '.join(f'{lr:g}' for lr in lrs)}" if lrs else ""
            row.append(text + (f" [{failed} diverged]" if failed else ""))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def half_report(records: list[dict], half: str) -> str:
    """The markdown of one half: the summary, one table per problem, the one-worker learning-rate study."""
    problems = TUNING if half == "tuning" else HELD_OUT
    mine = [r for r in records if r["problem"] in problems]
    bench_list = benches(mine, problems)
    rules = rules_present(mine)
    seeds = len({r["seed"] for r in mine})
    cells = scores_by_seed(mine)
    parts = [f"# Robustness benchmark, {half} half", "",
             "Scores in points (test accuracy x 100; R² x 100 for regression) at the final epoch, mean ± std over "
             "seeds. Δ 1 worker: the mean ± std over the seeds both finished of (this run − one worker's run of "
             "the same seed); Δ none: the same against this configuration under `--lr-scaling none`. "
             + ("Rules: " + "; ".join(f"`{rule}`: {RULES[rule]}" for rule in rules) + ". " if rules else "")
             + "Produced by `python benchmarks/robustness.py report`.", ""]
    if rules:
        parts.append(summary_tables(cells, bench_list, rules))
    parts += [table for table in (problem_table(bench, cells, rules, seeds) for bench in bench_list) if table]
    study = lr_study_table(mine, bench_list)
    if study:
        parts.append(study)
    return "\n".join(parts)


def report(runs: Path, out: Path, quiet: bool = False) -> list[dict]:
    """OUT/results.json (every run: those in `runs`, and those recorded there before, a run found in `runs`
    replacing its recorded self) and OUT/<half>.md."""
    def key(record: dict) -> tuple:
        return record["problem"], record["config"], record["workers"], record["rule"], record["seed"], record["epochs"]

    variances = _variances()
    recorded = out / "results.json"
    merged = {key(r): r for r in (json.loads(recorded.read_text())["runs"] if recorded.is_file() else [])}
    merged.update({key(r): r for r in collect(runs, variances)})
    records = sorted(merged.values(), key=key)
    out.mkdir(parents=True, exist_ok=True)
    problems = {name: {"half": half_of(name), "description": p.description, "epochs": p.epochs,
                       "flags": list(p.flags), "task": p.task, "data": p.data, "model": p.model,
                       **({"test_variance": variances[name]} if name in variances else {})}
                for name, p in PROBLEMS.items()}
    recorded.write_text(json.dumps({"problems": problems, "tuning": TUNING, "held_out": HELD_OUT,
                                    "rules": RULES, "runs": records}, indent=1))
    for half in ("tuning", "held-out"):
        if any(r["half"] == half for r in records):
            (out / f"{half}.md").write_text(half_report(records, half))
    if not quiet:
        print(f"{len(records)} runs; wrote {out / 'results.json'} and the tables beside it")
    return records


def list_all() -> None:
    for half, names in (("tuning", TUNING), ("held-out", HELD_OUT)):
        for name in names:
            p = PROBLEMS[name]
            print(f"{half:8s} {name:24s} {p.epochs:3d} epochs  {' '.join(p.flags) or '(defaults)'}: {p.description}")
    for name, (strategy, counts, flags, text) in CONFIGS.items():
        print(f"config {name}: --strategy {strategy} {' '.join(flags)} at W={','.join(map(str, counts))}: {text}")
    for name, text in RULES.items():
        print(f"rule {name}: {text}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["run", "report", "list"])
    parser.add_argument("--half", choices=["tuning", "held-out", "all"], default="tuning")
    parser.add_argument("--only", default=None, help="comma-separated problem names (within --half)")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated: {', '.join(CONFIGS)} (default: all; none when --lr-study is given)")
    parser.add_argument("--workers", default="2,4,8", help="worker counts of the multi-worker configurations")
    parser.add_argument("--rules", default="none,linear-warm", help=f"comma-separated: {', '.join(RULES)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lr-study", default=None, metavar="LR,LR",
                        help="also one worker with each explicit --lr, on the problems whose flags give none")
    parser.add_argument("--epochs", type=int, default=None,
                        help="instead of each problem's own number of epochs (quick checks; a separate run)")
    parser.add_argument("--runs", default=str(RUNS), help="run directories (not committed)")
    parser.add_argument("--out", default=str(OUT), help="results.json and the tables")
    parser.add_argument("--dry-run", action="store_true", help="print the runs that would be trained")
    args = parser.parse_args(argv)
    if args.action == "list":
        list_all()
        return 0
    if args.action == "report":
        report(Path(args.runs), Path(args.out))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
