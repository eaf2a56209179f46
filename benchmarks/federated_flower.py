"""dptrain's fedavg beside Flower's FedAvg: test accuracy per round on the same partitions, model and seeds.

    PYTHONPATH=src python benchmarks/federated_flower.py --out benchmarks/results/federated_flower

For each Dirichlet alpha and seed, every variant below trains the built-in `mlp` on `digits`
with 4 clients, one local epoch per round, SGD at the same lr and batch size:

    dptrain          `dptrain train --strategy fedavg --partition dirichlet ...` (its CLI, 4 processes);
                     each client's SGD momentum carries over from round to round
    flower           baselines/flower_fedavg.py --mode simulation: Flower's FedAvg strategy and
                     Ray simulation engine; its clients are built afresh each round (momentum from zero)
    dptrain-m0, flower-m0   the same two without momentum (no optimizer state to carry)
    flower-carry     Flower's FedAvg objects driven in-process with each client's optimizer kept
                     across rounds: the one difference between `dptrain` and `flower` undone

Both tools take the client partition and each client's batches from dptrain (the baseline imports
dptrain.data.partition), so the pairs (dptrain-m0, flower-m0) and (dptrain, flower-carry) are the
same computation and must agree to float rounding; `weights` in results.json says how closely.
Writes OUT/results.json (every curve, means, standard deviations, the comparisons), OUT/table.md
and OUT/plot.png; the run directories go to --work (not kept in the repository).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "benchmarks" / "baselines" / "flower_fedavg.py"

VARIANTS = {
    "dptrain": {"tool": "dptrain", "momentum": 0.9,
                "label": "dptrain fedavg, momentum 0.9 (carried across rounds)"},
    "flower": {"tool": "flower", "momentum": 0.9, "mode": "simulation",
               "label": "Flower FedAvg (Ray simulation), momentum 0.9 (fresh each round)"},
    "dptrain-m0": {"tool": "dptrain", "momentum": 0.0, "label": "dptrain fedavg, no momentum"},
    "flower-m0": {"tool": "flower", "momentum": 0.0, "mode": "simulation",
                  "label": "Flower FedAvg (Ray simulation), no momentum"},
    "flower-carry": {"tool": "flower", "momentum": 0.9, "mode": "inprocess", "carry": True,
                     "label": "Flower FedAvg (in-process), momentum 0.9 carried across rounds"},
    # Not run by default: needs a dptrain whose fedavg takes --optimizer-state (checked after the run).
    "dptrain-reset": {"tool": "dptrain", "momentum": 0.9, "extra": ["--optimizer-state", "reset"],
                      "label": "dptrain fedavg, momentum 0.9, --optimizer-state reset"},
}
DEFAULT_VARIANTS = ["dptrain", "flower", "dptrain-m0", "flower-m0", "flower-carry"]
# (a, b, whether they are the same computation and must agree to rounding)
PAIRS = [("dptrain", "flower", False), ("dptrain-m0", "flower-m0", True), ("dptrain", "flower-carry", True),
         ("flower-carry", "flower", False), ("dptrain-reset", "flower", True)]


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alphas", default="0.1,0.5")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {','.join(VARIANTS)}")
    parser.add_argument("--work", default="runs/federated_flower", help="run directories (kept out of the repository)")
    parser.add_argument("--reuse", action="store_true", help="keep run directories that already hold a summary.json")
    parser.add_argument("--replot", action="store_true", help="redraw OUT/table.md and OUT/plot.png from OUT/results.json")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants {','.join(unknown)} unknown; valid: {','.join(VARIANTS)}")
    return args


def command(variant: dict, alpha: float, seed: int, args, out: Path) -> list[str]:
    common = ["--alpha", str(alpha), "--seed", str(seed), "--batch-size", str(args.batch_size),
              "--lr", str(args.lr), "--momentum", str(variant["momentum"]), "--out", str(out)]
    if variant["tool"] == "dptrain":
        return [sys.executable, "-m", "dptrain", "train", "--strategy", "fedavg", "--partition", "dirichlet",
                "--workers", str(args.clients), "--local-epochs", "1", "--epochs", str(args.rounds),
                "--dataset", "digits", "--model", "mlp", "--optimizer", "sgd", "--checkpoint-every", "0",
                "--no-progress", *variant.get("extra", []), *common]
    return [sys.executable, str(BASELINE), "--partition", "dirichlet", "--clients", str(args.clients),
            "--rounds", str(args.rounds), "--dataset", "digits", "--model", "mlp", "--mode", variant["mode"],
            *(["--carry-momentum"] if variant.get("carry") else []), *common]


def run(cmd: list[str], out: Path, reuse: bool) -> dict:
    """Run one training (unless reused); its per-round test accuracy and wall time."""
    if not (reuse and (out / "summary.json").exists()):
        if out.exists():
            import shutil
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        started = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed with exit code {done.returncode}:\n{done.stderr[-2000:]}")
        (out / "process_seconds.txt").write_text(f"{time.perf_counter() - started:.3f}\n")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    if "--optimizer-state" in cmd and summary.get("strategy_options", {}).get("optimizer_state") != \
            cmd[cmd.index("--optimizer-state") + 1]:
        raise SystemExit(f"{out}: this dptrain's fedavg does not record --optimizer-state in summary.json "
                         "(strategy_options), so it did not apply it; run the variants without dptrain-reset")
    return {"accuracy": [r["test_accuracy"] for r in records], "rounds": [r["epoch"] for r in records],
            "wall_seconds": summary["wall_seconds"],
            "process_seconds": float((out / "process_seconds.txt").read_text())}


def mean_std(curves: list[list[float]]) -> tuple[list[float], list[float]]:
    """Per round: the mean over seeds and the sample standard deviation (0 for a single seed)."""
    columns = list(zip(*curves))
    return ([statistics.fmean(c) for c in columns],
            [statistics.stdev(c) if len(c) > 1 else 0.0 for c in columns])


def paired(a: list[float], b: list[float]) -> dict:
    """a - b over seeds (same seed = same partition): mean, sample sd and the 95% band of the mean (1.96 sd/sqrt n)."""
    differences = [x - y for x, y in zip(a, b)]
    sd = statistics.stdev(differences) if len(differences) > 1 else 0.0
    mean = statistics.fmean(differences)
    band = 1.96 * sd / math.sqrt(len(differences))
    return {"mean": mean, "sd": sd, "band95": band, "beyond_noise": abs(mean) > band}


def max_weight_difference(run_a: Path, run_b: Path) -> float:
    import torch
    a, b = torch.load(run_a / "model.pt"), torch.load(run_b / "model.pt")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def summarise(curves: dict, args, work: Path) -> dict:
    """curves[variant][alpha][seed] = run record -> means, comparisons."""
    seeds = [int(s) for s in args.seeds.split(",")]
    tail = max(1, args.rounds // 3)
    means, comparisons = {}, []
    for name, by_alpha in curves.items():
        for alpha, by_seed in by_alpha.items():
            runs = [by_seed[s] for s in seeds]
            mean, std = mean_std([r["accuracy"] for r in runs])
            means.setdefault(name, {})[alpha] = {
                "mean": mean, "std": std, "final": [r["accuracy"][-1] for r in runs],
                f"last_{tail}_rounds": [statistics.fmean(r["accuracy"][-tail:]) for r in runs],
                "wall_seconds": [r["wall_seconds"] for r in runs],
                "process_seconds": [r["process_seconds"] for r in runs]}
    for a, b, same in PAIRS:
        if a not in curves or b not in curves:
            continue
        for alpha in curves[a]:
            ma, mb = means[a][alpha], means[b][alpha]
            entry = {"a": a, "b": b, "alpha": alpha, "same_computation": same,
                     "final": paired(ma["final"], mb["final"]),
                     f"last_{tail}_rounds": paired(ma[f"last_{tail}_rounds"], mb[f"last_{tail}_rounds"]),
                     "largest_round_gap_of_means": max(abs(x - y) for x, y in zip(ma["mean"], mb["mean"])),
                     "rounds_with_identical_accuracy": sum(
                         all(curves[a][alpha][s]["accuracy"][r] == curves[b][alpha][s]["accuracy"][r] for s in seeds)
                         for r in range(args.rounds))}
            entry["max_weight_difference"] = max(
                max_weight_difference(run_dir(work, a, alpha, s), run_dir(work, b, alpha, s)) for s in seeds)
            comparisons.append(entry)
    return {"means": means, "comparisons": comparisons, "tail_rounds": tail}


def run_dir(work: Path, variant: str, alpha: str, seed: int) -> Path:
    return work / f"{variant}-alpha{alpha}-seed{seed}"


def table(results: dict) -> str:
    tail = results["tail_rounds"]
    lines = [f"Test accuracy of the global model (mean ± sample std over seeds {results['settings']['seeds']}; "
             f"{results['settings']['rounds']} rounds, {results['settings']['clients']} clients).", "",
             f"| variant | alpha | round 5 | round 10 | final | mean of last {tail} rounds | wall (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, by_alpha in results["means"].items():
        for alpha, m in by_alpha.items():
            cells = [f"{m['mean'][r - 1]:.3f} ± {m['std'][r - 1]:.3f}" if r <= len(m["mean"]) else "–" for r in (5, 10)]
            last = m[f"last_{tail}_rounds"]
            lines.append(f"| {VARIANTS[name]['label']} | {alpha} | {' | '.join(cells)} | "
                         f"{statistics.fmean(m['final']):.3f} ± {_sd(m['final']):.3f} | "
                         f"{statistics.fmean(last):.3f} ± {_sd(last):.3f} | "
                         f"{statistics.fmean(m['wall_seconds']):.2f} |")
    lines += ["", "wall: the tool's own training time (dptrain: summary.json; Flower: from the start of its "
              "simulation, Ray's start-up included) on a shared 2-core machine: not a speed comparison.",
              "", "Paired differences a − b over seeds (same seed = same partition and batches); "
              "band = 1.96 × sd / √n.", "",
              f"| a | b | alpha | final: mean ± band | last {tail}: mean ± band | beyond seed noise | "
              "rounds identical | max weight difference |", "|---|---|---:|---:|---:|:---:|---:|---:|"]
    for c in results["comparisons"]:
        f, t = c["final"], c[f"last_{tail}_rounds"]
        lines.append(f"| {c['a']} | {c['b']} | {c['alpha']} | {f['mean']:+.4f} ± {f['band95']:.4f} | "
                     f"{t['mean']:+.4f} ± {t['band95']:.4f} | {'yes' if t['beyond_noise'] else 'no'} | "
                     f"{c['rounds_with_identical_accuracy']}/{results['settings']['rounds']} | "
                     f"{c['max_weight_difference']:.2e} |")
    return "\n".join(lines) + "\n"


def _sd(values):
    return statistics.stdev(values) if len(values) > 1 else 0.0


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = list(next(iter(results["means"].values())).keys())
    figure, axes = plt.subplots(1, len(alphas), figsize=(6.5 * len(alphas), 4.5), squeeze=False)
    styles = {"dptrain": ("C0", "-"), "flower": ("C1", "-"), "dptrain-m0": ("C0", ":"), "flower-m0": ("C1", ":"),
              "flower-carry": ("C2", "--"), "dptrain-reset": ("C3", "-.")}
    for axis, alpha in zip(axes[0], alphas):
        for name, by_alpha in results["means"].items():
            m = by_alpha[alpha]
            rounds = range(1, len(m["mean"]) + 1)
            color, style = styles[name]
            wide = VARIANTS[name]["tool"] == "dptrain"  # wide and pale: a Flower curve on top of it stays visible
            axis.plot(rounds, m["mean"], color=color, linestyle=style, label=VARIANTS[name]["label"],
                      linewidth=4 if wide else 1.5, alpha=0.45 if wide else 1.0)
            axis.fill_between(rounds, [x - s for x, s in zip(m["mean"], m["std"])],
                              [x + s for x, s in zip(m["mean"], m["std"])], color=color, alpha=0.12)
        axis.set_title(f"digits, mlp, {results['settings']['clients']} clients, Dirichlet alpha = {alpha}\n"
                       "(dptrain's curves are the wide pale ones; those a Flower curve covers coincide)", fontsize=10)
        axis.set_xlabel("round (1 local epoch)")
        axis.set_ylabel("test accuracy (mean ± std over seeds)")
        axis.set_ylim(0, 1)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = arguments(argv)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        results = json.loads((out / "results.json").read_text())
        (out / "table.md").write_text(table(results))
        plot(results, out / "plot.png")
        print(table(results))
        return 0
    alphas, seeds = args.alphas.split(","), [int(s) for s in args.seeds.split(",")]
    curves: dict = {}
    for alpha in alphas:
        for seed in seeds:
            for name in args.variants.split(","):
                target = run_dir(work, name, alpha, seed)
                record = run(command(VARIANTS[name], float(alpha), seed, args, target), target, args.reuse)
                curves.setdefault(name, {}).setdefault(alpha, {})[seed] = record
                print(f"alpha {alpha} seed {seed} {name:13s} final {record['accuracy'][-1]:.4f} "
                      f"({record['process_seconds']:.1f} s)", flush=True)
    import flwr
    import torch
    results = {"settings": {"dataset": "digits", "model": "mlp", "clients": args.clients, "rounds": args.rounds,
                            "local_epochs": 1, "batch_size": args.batch_size, "lr": args.lr, "alphas": alphas,
                            "seeds": seeds, "flwr": flwr.__version__, "torch": torch.__version__,
                            "variants": {n: VARIANTS[n] for n in curves},
                            "commands": {n: " ".join(command(VARIANTS[n], float(alphas[0]), seeds[0], args,
                                                             run_dir(work, n, alphas[0], seeds[0]))[1:])
                                         for n in curves}},
               "runs": {n: {a: {str(s): r for s, r in by_seed.items()} for a, by_seed in by_alpha.items()}
                        for n, by_alpha in curves.items()}}
    results.update(summarise(curves, args, work))
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "table.md").write_text(table(results))
    plot(results, out / "plot.png")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
