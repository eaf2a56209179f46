"""`dptrain bench`: run the strategy x workers matrix (and baselines, and the synthetic throughput benchmark), write results and plots."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from dptrain.bench.matrix import BenchSpec, run_matrix
from dptrain.bench.netns import namespaces_unavailable, parse_rate
from dptrain.bench.results import format_summary, format_table, ratio, unreliable, write_results
from dptrain import registry
from dptrain.arguments import parse_key_values
from dptrain.config import FIELDS
from dptrain.errors import UserError
from dptrain.io import timestamped, write_json

SHOWN = ("strategy", "workers", "network", "runs", "final_accuracy", "time_to_target_seconds", "reached_target",
         "wall_seconds", "wall_seconds_ci", "epoch_seconds", "samples_per_second", "comm_bytes", "speedup", "efficiency")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Run every strategy at every worker count (and plain PyTorch baselines) in one go; write "
                          "results.csv, results.json and PNG plots to --out.")
    parser.add_argument("--strategies", default="allreduce,sync",
                        help=f"comma-separated, from {', '.join(registry.names('strategy'))}; 'none' runs only --throughput (default: allreduce,sync)")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts (default: 1,2)")
    parser.add_argument("--model", default="mlp", help="model of every run (default: mlp)")
    parser.add_argument("--dataset", default="digits", help="built-in data set of every run (default: digits)")
    parser.add_argument("--epochs", type=int, default=5, help="epochs per run (default: 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step and worker (default: 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default: 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every run (default: 0)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="any other `dptrain train` setting for every run, e.g. --option samples=4096 (repeatable)")
    parser.add_argument("--target-accuracy", type=float, default=None, help="record the time to reach this test accuracy")
    parser.add_argument("--bandwidth", default=None, metavar="RATE",
                        help="run each worker as its own host in a network namespace, links limited to RATE (e.g. 100mbit); needs root")
    parser.add_argument("--ranks-per-host", type=int, default=1, metavar="N",
                        help="ranks [kN, (k+1)N) share emulated host k under --bandwidth, and form node k of "
                             "hierarchical runs (--ranks-per-node N); every worker count must be 1 or a multiple (1)")
    parser.add_argument("--slow-worker", default=None, metavar="RANK:FACTOR", help="straggler emulation in every run with that rank: its steps take FACTOR times its own "
                             "compute (measured without communication, never its waits)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each configuration, interleaved (default: 1)")
    parser.add_argument("--no-baselines", dest="baselines", action="store_false",
                        help="skip the plain PyTorch loop, plain DDP and Horovod runs")
    parser.add_argument("--throughput", default=None, metavar="MODELS",
                        help="also run the synthetic throughput benchmark for these models, e.g. resnet,nfnet")
    parser.add_argument("--throughput-batch-size", type=int, default=32, help="synthetic benchmark: batch per worker (32)")
    parser.add_argument("--image-size", type=int, default=32, help="synthetic benchmark: image side (32)")
    parser.add_argument("--warmup", type=int, default=10, help="synthetic benchmark: untimed warm-up steps (10)")
    parser.add_argument("--iterations", type=int, default=10, help="synthetic benchmark: timed iterations (10)")
    parser.add_argument("--batches", type=int, default=10, help="synthetic benchmark: steps per iteration (10)")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of every rank of every run (default: cores / ranks, as `dptrain train`)")
    parser.add_argument("--run-timeout", dest="timeout", type=float, default=1800.0,
                        help="seconds one whole run may take before it is stopped (1800); not train's --timeout")
    parser.add_argument("--out", default=None, help="results directory (default: runs/bench-TIMESTAMP); must be new or empty")
    parser.add_argument("--replot", default=None, metavar="DIR",
                        help="run nothing: judge the rows of DIR/results.json again (recorded there), redraw its plots "
                             "and print its table")


def _list(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UserError(f"--{what} {text!r} names nothing; give a comma-separated list")
    return items


def _counts(text: str) -> list[int]:
    try:
        counts = [int(item) for item in _list(text, "workers")]
    except ValueError:
        raise UserError(f"--workers {text!r} is not a comma-separated list of whole numbers, e.g. 1,2,4") from None
    if any(n < 1 for n in counts):
        raise UserError(f"--workers {text!r} holds a count below 1; use counts of at least 1")
    return sorted(set(counts))


def spec_from(args: argparse.Namespace) -> BenchSpec:
    """The validated BenchSpec of the command line (no processes started)."""
    strategies = [] if args.strategies == "none" else _list(args.strategies, "strategies")
    for strategy in strategies:
        if strategy not in registry.names("strategy"):
            raise UserError(f"--strategies names {strategy!r}; valid strategies are "
                            f"{', '.join(registry.names('strategy'))} (or none)")
    if args.repeat < 1:
        raise UserError(f"--repeat {args.repeat} must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads} must be at least 1")
    if args.bandwidth:
        parse_rate(args.bandwidth)
        reason = namespaces_unavailable()
        if reason:
            raise UserError(reason)
    counts = _counts(args.workers)
    if args.ranks_per_host < 1:
        raise UserError(f"--ranks-per-host {args.ranks_per_host} must be at least 1")
    uneven = [n for n in counts if n > 1 and n % args.ranks_per_host]
    if uneven:
        raise UserError(f"--ranks-per-host {args.ranks_per_host} does not divide --workers {uneven[0]}; "
                        f"use worker counts that are 1 or multiples of {args.ranks_per_host}")
    train = {"model": args.model, "dataset": args.dataset, "epochs": args.epochs, "batch_size": args.batch_size,
             "lr": args.lr, "seed": args.seed,
             **parse_key_values(args.option, flag="--option", example="samples=4096", keys=FIELDS)}
    return BenchSpec(strategies=strategies, workers=counts, train=train,
                     target_accuracy=args.target_accuracy, bandwidth=args.bandwidth, slow_worker=args.slow_worker,
                     repeat=args.repeat, baselines=args.baselines, timeout=args.timeout,
                     threads=args.threads, ranks_per_host=args.ranks_per_host)


def _claim(out: Optional[str]) -> Path:
    directory = Path(out or timestamped("runs", "bench"))
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise UserError(f"--out '{directory}' exists and is not an empty directory; give a new one")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def headlines(summary: list[dict], widest: int) -> dict[str, Optional[float]]:
    """The issue's target ratios, from the means (None where a run is missing)."""
    return {
        "allreduce_vs_plain_ddp_samples_per_second": ratio(summary, "samples_per_second", ("allreduce", widest), ("plain-ddp", widest)),
        "dptrain_1_worker_vs_plain_loop_samples_per_second": ratio(summary, "samples_per_second", ("allreduce", 1), ("plain-loop", 1)),
        "allreduce_vs_sync_time_to_target": ratio(summary, "time_to_target_seconds", ("allreduce", widest), ("sync", widest)),
        "sync_vs_async_epoch_seconds": ratio(summary, "epoch_seconds", ("sync", widest), ("async", widest)),
    }


def main(args: argparse.Namespace) -> int:
    # matplotlib and torch load only when a command runs, not for `dptrain --help`
    from dptrain.bench.throughput import run_throughput

    if args.replot:
        return replot(Path(args.replot))
    spec = spec_from(args)
    models = _list(args.throughput, "throughput") if args.throughput else []
    for model in models:
        if model not in registry.names("model") or model in ("mlp", "mlp-regression"):
            raise UserError(f"--throughput names {model!r}; the synthetic benchmark takes image models: cnn, resnet, nfnet")
    if not spec.strategies and not models:
        raise UserError("--strategies none and no --throughput: nothing to run")
    out = _claim(args.out)
    meta: dict = {"command": "dptrain bench", "settings": {**vars(args)}, "train": spec.train,
                  "target_accuracy": spec.target_accuracy, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    meta["settings"].pop("option", None)
    result: dict = {"runs": [], "summary": [], "network": {"name": spec.bandwidth or "loopback"}, "notes": []}
    if spec.strategies:
        result = run_matrix(spec, out)
    throughput = []
    if models:
        bar = tqdm(total=len(models) * len(spec.workers), desc="throughput", unit="run", dynamic_ncols=True)
        throughput = run_throughput(models, spec.workers, out, batch_size=args.throughput_batch_size,
                                    image_size=args.image_size, warmup=args.warmup, iterations=args.iterations,
                                    batches=args.batches, timeout=args.timeout, progress=bar)
        bar.close()
    widest = max(spec.workers)
    meta.update(network=result["network"], notes=result["notes"], headlines=headlines(result["summary"], widest),
                throughput=throughput)
    write_results(out, result["runs"], result["summary"], meta)
    if throughput:
        write_json(out / "throughput.json", throughput)
    written = _report(out, result["runs"], result["summary"], throughput, spec.target_accuracy, meta["headlines"],
                      result["notes"])
    print(f"dptrain bench: results.csv, results.json and {', '.join(p.name for p in written)} in {out}")
    return 0


def _report(out: Path, runs: list[dict], summary: list[dict], throughput: list[dict], target: Optional[float],
            headline: dict, notes: list[str]) -> list[Path]:
    """Draw the plots into OUT and print the tables, headlines and notes; return the plots written."""
    from dptrain.bench import plots

    written = []
    if runs:
        written += [plots.plot_scaling(summary, out / "scaling.png"),
                    plots.plot_accuracy_vs_time(runs, out / "accuracy_vs_time.png", target, summary),
                    plots.plot_bytes(summary, out / "bytes.png")]
        print(format_summary(summary, SHOWN))
    if throughput:
        written.append(plots.plot_throughput(throughput, out / "throughput.png"))
        print(format_table(throughput, ("model", "workers", "batch_size", "image_size", "images_per_second_per_worker",
                                        "ci", "images_per_second")))
    for name, value in headline.items():
        if value is not None:
            print(f"{name}: {value:.3f}")
    for note in notes:
        print(f"note: {note}")
    return written


def replot(directory: Path) -> int:
    """`--replot DIR`: the rows of DIR/results.json judged again (and the judgements written back),
    its plots redrawn and its tables printed, from what was recorded; nothing runs."""
    import json

    path = directory / "results.json"
    try:
        results = json.loads(path.read_text())
        summary, runs = results["summary"], results["runs"]
    except FileNotFoundError:
        raise UserError(f"--replot '{directory}' holds no results.json; give a directory written by dptrain bench") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--replot: '{path}' is not a dptrain bench results.json ({exc})") from None
    for row in summary:
        row["unreliable"] = unreliable(row)
    write_json(path, results)
    written = _report(directory, runs, summary, results.get("throughput") or [], results.get("target_accuracy"),
                      results.get("headlines") or {}, results.get("notes") or [])
    print(f"dptrain bench: {', '.join(p.name for p in written) or 'no plots'} redrawn and results.json judged again "
          f"in {directory}")
    return 0
