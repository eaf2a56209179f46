"""`dptrain simulate`: project epoch time and scaling efficiency to many workers from a measured `dptrain bench` run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dptrain import costmodel
from dptrain.bench.netns import parse_rate
from dptrain.bench.results import format_table
from dptrain.errors import UserError
from dptrain.io import write_json

PROJECTION_COLUMNS = ("strategy", "workers", "steps_per_epoch", "compute_seconds", "communication_seconds",
                      "epoch_seconds", "speedup", "efficiency")
VALIDATION_COLUMNS = ("strategy", "workers", "measured_epoch_seconds", "predicted_epoch_seconds", "error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Project time per epoch and scaling efficiency to many workers with an alpha-beta model "
                          "calibrated from a `dptrain bench` directory; compare its predictions with the measured runs.")
    parser.add_argument("--from", dest="source", required=True, metavar="DIR", help="a `dptrain bench` results directory")
    parser.add_argument("--strategies", default="allreduce,sync,async", help="strategies to project (allreduce,sync,async)")
    parser.add_argument("--max-workers", type=int, default=1024, help="project up to this many workers, powers of two (1024)")
    parser.add_argument("--bandwidth", default=None, metavar="RATE",
                        help="link rate, e.g. 10gbit (default: the rate measured on the bench's emulated network)")
    parser.add_argument("--latency", type=float, default=None, metavar="SECONDS",
                        help="alpha, seconds per message (default: half the measured round trip)")
    parser.add_argument("--samples", type=int, default=None, help="training samples per epoch (default: as measured)")
    parser.add_argument("--out", default=None, help="where projection.json/.csv and projection.png go (default: the --from directory)")


def load_bench(directory: Path) -> dict:
    path = directory / "results.json"
    if not path.is_file():
        raise UserError(f"--from '{directory}' holds no results.json; give a directory written by `dptrain bench`")
    return json.loads(path.read_text())


def main(args: argparse.Namespace) -> int:
    from dptrain.bench import plots  # matplotlib loads only when a command draws, not for `dptrain --help`

    source = Path(args.source)
    bench = load_bench(source)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in costmodel.STRATEGIES]
    if unknown or not strategies:
        raise UserError(f"--strategies {args.strategies!r}: valid strategies are {', '.join(costmodel.STRATEGIES)}")
    if args.max_workers < 1:
        raise UserError(f"--max-workers {args.max_workers} must be at least 1")
    bandwidth = parse_rate(args.bandwidth) / 8 if args.bandwidth else None
    network = bench.get("network", {})
    try:
        cal = costmodel.calibrate(bench["runs"], network, bandwidth=bandwidth, latency=args.latency)
    except ValueError as exc:
        raise UserError(f"cannot calibrate from '{source}': {exc} (e.g. --bandwidth 10gbit)") from None
    # 1-worker runs have the machine to themselves; compute was calibrated with all workers busy.
    validation = [row for row in costmodel.validate(bench["runs"], cal) if row["workers"] > 1]
    if args.samples:
        cal = costmodel.Calibration(**{**cal.as_dict(), "samples": args.samples})
    rows = costmodel.project(strategies, costmodel.powers_of_two(args.max_workers), cal)

    out = Path(args.out) if args.out else source
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "projection.json", {"calibration": cal.as_dict(), "network": network, "projection": rows,
                                         "validation": validation})
    with open(out / "projection.csv", "w") as handle:
        handle.write(",".join(PROJECTION_COLUMNS) + "\n")
        for row in rows:
            handle.write(",".join(f"{row[key]:.6g}" if isinstance(row[key], float) else str(row[key])
                                  for key in PROJECTION_COLUMNS) + "\n")
    plots.plot_projection(rows, out / "projection.png")

    print(f"calibration: {cal.seconds_per_sample * 1e6:.1f} us per sample, model {cal.model_bytes:,} bytes, "
          f"bandwidth {cal.bandwidth * 8 / 1e6:.1f} Mbit/s, latency {cal.latency * 1e6:.0f} us, "
          f"{cal.samples} samples, batch {cal.batch_size}")
    print(format_table(rows, PROJECTION_COLUMNS))
    print(f"\nvalidation on the measured multi-worker runs ({network.get('name', 'loopback')}; compute per sample "
          f"was taken from sync at the largest worker count):")
    print(format_table(validation, VALIDATION_COLUMNS))
    print(f"dptrain simulate: projection.json, projection.csv and projection.png in {out}")
    return 0
