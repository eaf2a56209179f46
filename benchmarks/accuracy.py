"""Accuracy at equal epochs: one worker against sync, async and fedavg on 2, 4 and 8 workers (issue 12).

Every run is a real `dptrain train` subprocess (one thread per rank). A run is identified by
(benchmark, configuration, workers, seed, epochs); its directory is RUNS/<bench>/<epochs>ep/<config>-w<W>/seed<S>,
and a run whose directory holds summary.json is not run again, so the script can be stopped and
restarted at any time (an unfinished directory is deleted and run again). After every run the
results are collected again from all finished directories:

- OUT/results.json: every run (command, final test accuracy and loss, wall time, bytes, the
  test accuracy of every epoch), and the mean/std over seeds of each configuration;
- OUT/<bench>-<epochs>ep.md: mean ± std test accuracy per configuration and worker count, and the
  difference to one worker;
- OUT/<bench>-<epochs>ep.png: test accuracy against epoch, mean over seeds, one panel per worker count.

    python benchmarks/accuracy.py run --bench mnist1d-adam --only 'one-worker,sync-e*' --workers 2,4 --seeds 0,1,2
    python benchmarks/accuracy.py run --bench nfnet --epochs 8 --only one-worker,sync-e1 --workers 2
    python benchmarks/accuracy.py report          # tables and plots again from the finished runs
    python benchmarks/accuracy.py list            # the benchmarks and configurations
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each benchmark: the flags every run shares, and its default number of epochs.
BENCHES: dict[str, tuple[list[str], int, str]] = {
    # MNIST-1D's published CNN baseline (Greydanus 2020): Adam, lr 0.01, batch 100, 6000 steps = 150 epochs.
    "mnist1d-adam": (["--dataset", "mnist1d", "--model", "cnn1d", "--optimizer", "adam", "--lr", "0.01",
                      "--batch-size", "100"], 150, "MNIST-1D, cnn1d, Adam lr 0.01, batch 100 per worker"),
    # The same with SGD + momentum (no published figure; the 1-worker row is the reference).
    "mnist1d-sgd": (["--dataset", "mnist1d", "--model", "cnn1d", "--optimizer", "sgd", "--lr", "0.05",
                     "--momentum", "0.9", "--batch-size", "100"], 150,
                    "MNIST-1D, cnn1d, SGD lr 0.05 momentum 0.9, batch 100 per worker"),
    # examples/nfnet.md's image case, smaller so that it runs on 2 shared cores.
    "nfnet": (["--dataset", "synthetic-images", "--model", "nfnet", "--samples", "1024", "--image-size", "16",
               "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--grad-clip", "1.0",
               "--batch-size", "32"], 8,
              "synthetic-images (1,024 samples, 16x16 RGB), nfnet, SGD lr 0.05 momentum 0.9, clip 1, batch 32"),
}

# Each configuration: (strategy, flags given the worker count W, one line of help). "one-worker" runs at W = 1 only.
CONFIGS: dict[str, tuple[str, object, str]] = {
    "one-worker": ("allreduce", lambda w: [], "one worker, the serial reference"),
    "allreduce": ("allreduce", lambda w: [], "gradient all-reduce every step"),
    "sync-e1": ("sync", lambda w: ["--sync-every", "1"], "sync, average every epoch"),
    "sync-e2": ("sync", lambda w: ["--sync-every", "2"], "sync, average every 2 epochs"),
    "sync-e3": ("sync", lambda w: ["--sync-every", "3"], "sync, average every 3 epochs"),
    "async": ("async", lambda w: [], "async, merge every epoch"),
    "fedavg": ("fedavg", lambda w: [], "fedavg, IID partitions, 1 local epoch per round"),
    # The defaults of issue 12 (LR x W, warm-up over a tenth of the run, at most 5 epochs; pinned by flags in
    # command() since issue 20 changed the default). Every other configuration runs with --lr-scaling none
    # unless it scales the LR itself: the settings they were measured with.
    "sync-e1-default": ("sync", lambda w: [], "sync every epoch, issue 12's defaults (LR x W, warmed up)"),
    "async-default": ("async", lambda w: [], "async, issue 12's defaults (LR x W, warmed up)"),
    "fedavg-default": ("fedavg", lambda w: [], "fedavg IID, issue 12's defaults (LR x W, warmed up)"),
    "sync-e1-int8": ("sync", lambda w: ["--compression", "int8"],
                     "sync every epoch, issue 12's defaults, averages of int8 changes with error feedback"),
    # Candidates for sync's default (issue 12, question 3); all average every epoch.
    "sync-e1-sum": ("sync", lambda w: ["--outer", "nesterov", "--outer-lr", str(w), "--outer-momentum", "0"],
                    "outer SGD lr W, no momentum: the sum of the workers' changes instead of their mean"),
    "sync-e1-diloco": ("sync", lambda w: ["--outer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9"],
                       "outer Nesterov lr 0.7 momentum 0.9 (DiLoCo's, dptrain's --outer defaults)"),
    "sync-e1-nesterov1": ("sync", lambda w: ["--outer", "nesterov", "--outer-lr", "1", "--outer-momentum", "0.9"],
                          "outer Nesterov lr 1 momentum 0.9"),
    "sync-e1-sum-half": ("sync", lambda w: ["--outer", "nesterov", "--outer-lr", str((1 + w) / 2),
                                            "--outer-momentum", "0"],
                         "outer SGD lr (1+W)/2, no momentum: halfway between the mean and the sum"),
    "sync-e1-outer-gain-w": ("sync", lambda w: ["--outer", "nesterov", "--outer-lr", f"{0.1 * w:.6g}",
                                                 "--outer-momentum", "0.9"],
                             "outer Nesterov lr 0.1*W momentum 0.9: long-run gain lr/(1-m) = W, the sum's, smoothed"),
    "sync-e1-sum-m5": ("sync", lambda w: ["--outer", "nesterov", "--outer-lr", str(w / 2), "--outer-momentum", "0.5"],
                       "outer Nesterov lr W/2 momentum 0.5 (the same long-run step as the sum)"),
    "sync-e1-scale-lr": ("sync", lambda w: ["--scale-lr"], "inner learning rate x W"),
    "sync-e1-scale-lr-warmup": ("sync", lambda w: ["--scale-lr", "--warmup-epochs", "5"],
                                "inner learning rate x W, linear warm-up over 5 epochs"),
    "sync-e1-sqrt-lr": ("sync", lambda w: ["__lr_times__", str(w ** 0.5)], "inner learning rate x sqrt(W)"),
    "sync-e1-sqrt-lr-warmup": ("sync", lambda w: ["__lr_times__", str(w ** 0.5), "--warmup-epochs", "5"],
                               "inner learning rate x sqrt(W), linear warm-up over 5 epochs"),
    "sync-e1-avg-state": ("sync", lambda w: ["--optimizer-state", "average"], "optimizer state averaged too"),
    "sync-e1-sum-avg-state": ("sync", lambda w: ["--outer", "nesterov", "--outer-lr", str(w), "--outer-momentum", "0",
                                                 "--optimizer-state", "average"],
                              "the sum of changes, optimizer state averaged"),
}

STANDARD = ["one-worker", "sync-e1", "sync-e2", "sync-e3", "async", "fedavg"]


def run_dir(runs: Path, bench: str, epochs: int, config: str, workers: int, seed: int) -> Path:
    return runs / bench / f"{epochs}ep" / f"{config}-w{workers}" / f"seed{seed}"


def command(bench: str, epochs: int, config: str, workers: int, seed: int, out: Path) -> list[str]:
    common, _, _ = BENCHES[bench]
    strategy, flags, _ = CONFIGS[config]
    extra = list(flags(workers))
    common = list(common)
    if extra[:1] == ["__lr_times__"]:  # a learning rate relative to the benchmark's
        at = common.index("--lr")
        common[at + 1] = f"{float(common[at + 1]) * float(extra[1]):.6g}"
        extra = extra[2:]
    if config.endswith(("-default", "-int8")):
        # The defaults of issue 12, pinned since the default changed (issue 20): x W, warmed up over a tenth
        # of the run, at most 5 epochs, unguarded.
        extra = ["--lr-scaling", "linear", "--warmup-epochs", f"{min(5.0, epochs / 10):g}", *extra]
    elif "--scale-lr" not in extra:
        extra = ["--lr-scaling", "none", *extra]
    return [sys.executable, "-m", "dptrain", "train", *common, "--epochs", str(epochs), "--strategy", strategy,
            "--workers", str(workers), *extra, "--seed", str(seed), "--no-progress", "--checkpoint-every", "0",
            "--out", str(out)]


def run_one(cmd: list[str], out: Path, meta: dict, timeout: float) -> None:
    if out.exists():
        shutil.rmtree(out)  # an unfinished run starts again from scratch
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    print(f"[{time.strftime('%H:%M:%S')}] {meta['bench']} {meta['config']} W={meta['workers']} seed={meta['seed']} "
          f"{meta['epochs']} epochs", flush=True)
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        returncode, stderr = done.returncode, done.stderr
    except subprocess.TimeoutExpired as expired:
        returncode, stderr = None, f"timed out after {timeout:.0f} s: {expired.stderr or ''}"
    meta = {**meta, "command": cmd[2:], "returncode": returncode, "seconds": round(time.monotonic() - started, 1)}
    out.mkdir(parents=True, exist_ok=True)
    if returncode != 0:
        # A diverged or failed run is a result too (its cost in stability): recorded, not run again.
        meta["error"] = "\n".join((stderr or "").strip().splitlines()[-3:])
        print(f"    failed ({returncode}): {meta['error']}", flush=True)
    (out / "accuracy_run.json").write_text(json.dumps(meta, indent=1))


def collect(runs: Path) -> list[dict]:
    """Every finished run under `runs` (successful or failed), with its per-epoch test accuracy."""
    records = []
    for meta_path in sorted(runs.glob("*/*ep/*/seed*/accuracy_run.json")):
        meta = json.loads(meta_path.read_text())
        record = {key: meta[key] for key in ("bench", "config", "workers", "seed", "epochs", "command",
                                             "returncode", "seconds")}
        summary_path, metrics_path = meta_path.parent / "summary.json", meta_path.parent / "metrics.jsonl"
        if meta.get("returncode") == 0 and summary_path.exists():
            summary = json.loads(summary_path.read_text())
            record.update(test_accuracy=summary.get("test_accuracy"), test_loss=summary.get("test_loss"),
                          wall_seconds=summary.get("wall_seconds"), comm_bytes=summary.get("comm_bytes"))
        else:
            record.update(test_accuracy=None, error=meta.get("error", "no summary.json"))
        curve = []
        if metrics_path.exists():
            for line in metrics_path.read_text().splitlines():
                row = json.loads(line)
                if row.get("test_accuracy") is not None:
                    curve.append([row["epoch"], row["test_accuracy"], row.get("train_loss")])
        record["curve"] = curve  # [epoch, test accuracy, train loss]
        records.append(record)
    return records


def aggregate(records: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault((record["bench"], record["epochs"], record["config"], record["workers"]), []).append(record)
    rows = []
    for (bench, epochs, config, workers), members in sorted(groups.items(), key=lambda kv: _order(kv[0])):
        accuracies = [m["test_accuracy"] for m in members if m["test_accuracy"] is not None]
        rows.append({"bench": bench, "epochs": epochs, "config": config, "workers": workers,
                     "seeds": sorted(m["seed"] for m in members), "failed": len(members) - len(accuracies),
                     "mean": statistics.fmean(accuracies) if accuracies else None,
                     "std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0 if accuracies else None,
                     "accuracies": accuracies,
                     "by_seed": {str(m["seed"]): m["test_accuracy"] for m in members if m["test_accuracy"] is not None}})
    return rows


def _order(key: tuple) -> tuple:
    bench, epochs, config, workers = key
    names = list(CONFIGS)
    return bench, epochs, names.index(config) if config in names else len(names), config, workers


def table(rows: list[dict], bench: str, epochs: int) -> str:
    mine = [r for r in rows if r["bench"] == bench and r["epochs"] == epochs]
    reference = next((r for r in mine if r["config"] == "one-worker" and r["mean"] is not None), None)
    lines = [f"### {bench}, {epochs} epochs: {BENCHES[bench][2] if bench in BENCHES else bench}", "",
             "Test accuracy of the final model, mean ± std over seeds (n = seeds that finished); "
             "Δ = mean minus one worker's mean, in points; paired Δ = the mean over the seeds both have of "
             "(this run − one worker's run of the same seed), in points.", "",
             "| configuration | workers | test accuracy | Δ vs 1 worker | paired Δ | n | failed |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in mine:
        paired = ""
        if r["mean"] is None:
            accuracy, delta = "—", "—"
        else:
            accuracy = f"{r['mean']:.4f} ± {r['std']:.4f}"
            delta = "" if reference is None or r is reference else f"{100 * (r['mean'] - reference['mean']):+.1f}"
            common = [] if reference is None or r is reference else sorted(set(r["by_seed"]) & set(reference["by_seed"]))
            if common:
                paired = f"{100 * statistics.fmean(r['by_seed'][k] - reference['by_seed'][k] for k in common):+.1f}"
        lines.append(f"| {r['config']} | {r['workers']} | {accuracy} | {delta} | {paired} | {len(r['accuracies'])} | "
                     f"{r['failed']} |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], bench: str, epochs: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in records if r["bench"] == bench and r["epochs"] == epochs and r["curve"]]
    worker_counts = sorted({r["workers"] for r in mine if r["workers"] > 1}) or [1]
    # Top row: whole runs; bottom row: the same zoomed on the last 80 % of the epochs near the top.
    fig, axes = plt.subplots(2, len(worker_counts), figsize=(5 * len(worker_counts), 7.5), squeeze=False)
    configs = [c for c in CONFIGS if any(r["config"] == c for r in mine)]
    colors = {c: plt.cm.tab20(i % 20) for i, c in enumerate(configs)}
    top = max((a for r in mine for _, a, _ in r["curve"]), default=1.0)
    for column, workers in enumerate(worker_counts):
        for config in configs:
            runs = [r for r in mine if r["config"] == config and (r["workers"] == workers or config == "one-worker")]
            if not runs:
                continue
            length = min(len(r["curve"]) for r in runs)
            xs = [runs[0]["curve"][i][0] for i in range(length)]
            ys = [statistics.fmean(r["curve"][i][1] for r in runs) for i in range(length)]
            style = dict(color="black", linestyle=":") if config == "one-worker" else dict(color=colors[config])
            for ax in axes[:, column]:
                ax.plot(xs, ys, label=f"{config} (n={len(runs)})", linewidth=1.2, **style)
        axes[0][column].set_title(f"{workers} workers" if workers > 1 else "1 worker")
        axes[1][column].set_xlim(0.2 * epochs, epochs)
        axes[1][column].set_ylim(top - 0.08, top + 0.005)
        for ax in axes[:, column]:
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (mean over seeds)")
    axes[1][0].set_ylabel("zoomed")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{bench}, {epochs} epochs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(runs: Path, out: Path) -> None:
    """Tables and plots of every run: those in `runs`, and those recorded in OUT/results.json before
    (their directories are not committed), a run found in `runs` replacing its recorded self."""
    def key(record: dict) -> tuple:
        return record["bench"], record["epochs"], record["config"], record["workers"], record["seed"]

    recorded = out / "results.json"
    merged = {key(r): r for r in (json.loads(recorded.read_text())["runs"] if recorded.is_file() else [])}
    merged.update({key(r): r for r in collect(runs)})
    records = list(merged.values())
    rows = aggregate(records)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({
        "benches": {name: {"flags": flags, "help": text} for name, (flags, _, text) in BENCHES.items()},
        "configs": {name: {"strategy": strategy, "help": text} for name, (strategy, _, text) in CONFIGS.items()},
        "summary": rows, "runs": records}, indent=1))
    for bench, epochs in sorted({(r["bench"], r["epochs"]) for r in rows}):
        (out / f"{bench}-{epochs}ep.md").write_text(table(rows, bench, epochs))
        plot(records, bench, epochs, out / f"{bench}-{epochs}ep.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["run", "report", "list"])
    parser.add_argument("--bench", default="mnist1d-adam", help=f"comma-separated: {', '.join(BENCHES)}")
    parser.add_argument("--only", default=",".join(STANDARD),
                        help="comma-separated configuration names or globs (default: the standard matrix)")
    parser.add_argument("--workers", default="2,4,8", help="worker counts of the multi-worker configurations")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=None, help="default: the benchmark's own")
    parser.add_argument("--runs", default=str(ROOT / "runs" / "accuracy"), help="run directories (not committed)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "accuracy"))
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    parser.add_argument("--dry-run", action="store_true", help="print the commands of the missing runs only")
    args = parser.parse_args()
    runs, out = Path(args.runs), Path(args.out)
    if args.action == "list":
        for name, (flags, epochs, text) in BENCHES.items():
            print(f"bench {name}: {text}; {epochs} epochs")
        for name, (strategy, _, text) in CONFIGS.items():
            print(f"config {name}: {strategy}: {text}")
        return 0
    if args.action == "report":
        report(runs, out)
        return 0
    patterns = args.only.split(",")
    configs = [c for c in CONFIGS if any(fnmatch.fnmatchcase(c, p) for p in patterns)]
    benches = args.bench.split(",")
    for bench in benches:
        if bench not in BENCHES:
            parser.error(f"unknown bench '{bench}'; valid: {', '.join(BENCHES)}")
    if not configs:
        parser.error(f"--only {args.only} matches no configuration; valid: {', '.join(CONFIGS)}")
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs {args.epochs} is invalid; use a positive integer")
    seeds = [int(s) for s in args.seeds.split(",")]
    worker_counts = [int(w) for w in args.workers.split(",")]
    # Seed-major order: the first seed of every configuration comes before any second seed.
    for seed in seeds:
        for bench in benches:
            epochs = args.epochs if args.epochs is not None else BENCHES[bench][1]
            for config in configs:
                for workers in ([1] if config == "one-worker" else worker_counts):
                    target = run_dir(runs, bench, epochs, config, workers, seed)
                    if (target / "accuracy_run.json").exists():
                        continue
                    cmd = command(bench, epochs, config, workers, seed, target)
                    if args.dry_run:
                        print(" ".join(cmd[2:]))
                        continue
                    run_one(cmd, target, {"bench": bench, "config": config, "workers": workers, "seed": seed,
                                          "epochs": epochs}, args.timeout)
                    report(runs, out)
    if not args.dry_run:
        report(runs, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
