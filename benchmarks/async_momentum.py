"""async merge rules side by side: delta, ema and delayed-nesterov, with and without a 3x straggler.

    python benchmarks/async_momentum.py benchmarks/results/async_momentum            # run, then table + plot
    python benchmarks/async_momentum.py benchmarks/results/async_momentum --replot   # table + plot again

Every run is `dptrain train --strategy async` on one data set for the same number of epochs
(test accuracy at equal epochs), against one worker training alone on all the data (with one
worker `--merge delta` adds the whole change: plain training). Async runs differ from run to
run (merge order), so each setting runs for several seeds. `results.json` is rewritten after
every run, so an interrupted measurement keeps what it has; `--replot` only redraws.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MERGES = {  # label -> dptrain train flags
    "delta": ["--merge", "delta"],
    "ema": ["--merge", "ema"],
    "delayed-nesterov": ["--merge", "delayed-nesterov"],  # --server-momentum 0.9 --server-lr 1.0 (defaults)
    "delayed-nesterov lr 0.5": ["--merge", "delayed-nesterov", "--server-lr", "0.5"],
}
COMPRESSED = {  # label -> flags, measured at 2 workers without a straggler
    "delta int8": ["--merge", "delta", "--compression", "int8"],
    "delayed-nesterov int8": ["--merge", "delayed-nesterov", "--compression", "int8"],
}
STRAGGLERS = {"equal": [], "3x straggler": ["--slow-worker", "1:3"]}
COLORS = dict(zip(MERGES, ["tab:blue", "tab:orange", "tab:green", "tab:red"]))  # the same in every plot


def run(common: list[str], flags: list[str], workers: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dptrain", "train", *common, "--strategy", "async",
                        "--workers", str(workers), "--seed", str(seed), *flags, "--out", f"{tmp}/run"],
                       check=True, stdout=subprocess.DEVNULL)
        summary = json.loads(Path(f"{tmp}/run/summary.json").read_text())
        records = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
    return {"test_accuracy": summary["test_accuracy"], "test_loss": summary["test_loss"],
            "wall_seconds": summary["wall_seconds"], "process_seconds": time.perf_counter() - started,
            "comm_bytes_per_worker": summary["comm_bytes_per_worker"], "merges": summary.get("merges"),
            "max_staleness_seen": summary.get("max_staleness_seen"),
            # rank 0's evaluation of the global model at each of its epoch ends
            "curve": [r.get("test_accuracy") for r in records]}


def plan(args) -> list[dict]:
    """Every run, as (setting keys, flags); interleaved by seed so a cut-short run still covers each setting."""
    runs = []
    for seed in args.seeds:
        runs.append({"merge": "one worker", "workers": 1, "straggler": "equal", "seed": seed, "flags": MERGES["delta"]})
        for workers in args.workers:
            for straggler, slow in STRAGGLERS.items():
                for merge in args.merges:
                    flags = MERGES[merge]
                    runs.append({"merge": merge, "workers": workers, "straggler": straggler, "seed": seed,
                                 "flags": flags + slow})
        for merge, flags in (COMPRESSED.items() if args.compressed else ()):
            runs.append({"merge": merge, "workers": 2, "straggler": "equal", "seed": seed, "flags": flags})
    return runs


def key(row: dict) -> tuple:
    return row["merge"], row["workers"], row["straggler"]


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    table = []
    for (merge, workers, straggler), group in groups.items():
        accuracy = [r["test_accuracy"] for r in group]
        table.append({"merge": merge, "workers": workers, "straggler": straggler, "runs": len(group),
                      "accuracy_mean": statistics.mean(accuracy),
                      "accuracy_std": statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0,
                      "accuracy_min": min(accuracy), "accuracy_max": max(accuracy),
                      "wall_mean": statistics.mean(r["wall_seconds"] for r in group),
                      "bytes_rank1": statistics.mean(r["comm_bytes_per_worker"][1] for r in group) if workers > 1 else 0})
    return table


def write_table(results: dict, out: Path) -> None:
    lines = [f"Test accuracy after {results['epochs']} epochs ({results['model']} on {results['dataset']}, "
             f"flags {' '.join(results['common_flags'])}), "
             f"seeds {', '.join(map(str, results['seeds']))}; mean ± std (min–max) over the seeds.", "",
             "| merge | workers | workers' speed | runs | test accuracy | min–max | training wall (s) | bytes, rank 1 |",
             "|-------|--------:|----------------|-----:|--------------:|--------:|------------------:|--------------:|"]
    for row in results["table"]:
        lines.append(f"| {row['merge']} | {row['workers']} | {row['straggler']} | {row['runs']} | "
                     f"{row['accuracy_mean']:.3f} ± {row['accuracy_std']:.3f} | "
                     f"{row['accuracy_min']:.3f}–{row['accuracy_max']:.3f} | {row['wall_mean']:.2f} | "
                     f"{row['bytes_rank1']:,.0f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")


def plot(results: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    merges = [m for m in MERGES if any(r["merge"] == m for r in results["runs"])]
    settings = [(w, s) for w in results["workers"] for s in STRAGGLERS]
    baseline = [r["test_accuracy"] for r in results["runs"] if r["merge"] == "one worker"]
    fig, grid = plt.subplots(2, len(settings), figsize=(3.2 * len(settings), 6.6), sharey="row")
    axes, curves = grid[0], grid[1]
    for axis, (workers, straggler) in zip(curves, settings):  # rank 0's evaluations of the global, mean over seeds
        for merge in ["one worker", *merges]:
            runs = [r["curve"] for r in results["runs"] if r["merge"] == merge and
                    (merge == "one worker" or (r["workers"], r["straggler"]) == (workers, straggler))]
            if runs and all(None not in c for c in runs):
                mean = [statistics.mean(values) for values in zip(*runs)]
                axis.plot(range(1, len(mean) + 1), mean, label=merge,
                          **({"color": "grey", "linestyle": ":"} if merge == "one worker" else
                             {"color": COLORS[merge]}))
        axis.set_xlabel("epoch (rank 0's)", fontsize=8)
        axis.set_ylim(0.5, 1.0)
    curves[0].set_ylabel("global model's test accuracy")
    curves[-1].legend(fontsize=7, loc="lower right")
    for axis, (workers, straggler) in zip(axes, settings):
        for x, merge in enumerate(merges):
            values = [r["test_accuracy"] for r in results["runs"]
                      if (r["merge"], r["workers"], r["straggler"]) == (merge, workers, straggler)]
            if values:
                axis.scatter([x] * len(values), values, s=18, alpha=0.7, color=COLORS[merge])
                axis.hlines(statistics.mean(values), x - 0.3, x + 0.3, color="black")
        if baseline:
            axis.axhline(statistics.mean(baseline), color="grey", linestyle=":", label="one worker")
        axis.set_xticks(range(len(merges)), [m.replace(" lr", "\nlr") for m in merges], rotation=30, fontsize=7)
        axis.set_title(f"{workers} workers, {straggler}", fontsize=9)
    axes[0].set_ylabel(f"test accuracy after {results['epochs']} epochs")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--replot", action="store_true", help="redraw table.md and accuracy.png from results.json")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr", help="the workers' learning rate (default: dptrain's, 0.05)")
    parser.add_argument("--merges", nargs="+", default=list(MERGES), choices=list(MERGES))
    parser.add_argument("--no-compressed", dest="compressed", action="store_false",
                        help="leave out the int8 runs (2 workers, equal speed)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    if args.replot:
        results = json.loads(path.read_text())
    else:
        common = ["--dataset", args.dataset, "--model", args.model, "--epochs", str(args.epochs), "--no-progress",
                  "--checkpoint-every", "0", *(["--lr", args.lr] if args.lr else [])]
        results = {"dataset": args.dataset, "model": args.model, "epochs": args.epochs, "workers": args.workers,
                   "seeds": args.seeds, "common_flags": common, "command": sys.argv[1:], "runs": []}
        for item in plan(args):
            flags = item.pop("flags")
            measured = run(common, flags, item["workers"], item["seed"])
            results["runs"].append({**item, "flags": flags, **measured})
            print(f"{item['merge']:>24} W={item['workers']} {item['straggler']:>12} seed {item['seed']}: "
                  f"{measured['test_accuracy']:.4f}", flush=True)
            results["table"] = summarise(results["runs"])
            path.write_text(json.dumps(results, indent=1) + "\n")
    results["table"] = summarise(results["runs"])
    path.write_text(json.dumps(results, indent=1) + "\n")
    write_table(results, args.out)
    plot(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
