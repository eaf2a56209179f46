"""Did `--strategy auto` pick what the measurements say is fastest? Reads a `dptrain bench` directory run with
`--strategies allreduce,sync,auto` and prints, per auto run, what it measured, predicted and chose, next to
the measured median epochs of the direct allreduce and sync runs of the same bench.

    .venv/bin/python benchmarks/auto_decisions.py benchmarks/results/auto-100mbit [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

LABELS = {"allreduce": "allreduce", "sync every 1": "sync"}


def median_epoch(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(record["epoch_seconds"] for record in records)


def decisions(bench: Path) -> dict:
    results = json.loads((bench / "results.json").read_text())
    measured: dict[str, list[float]] = {}
    autos = []
    for run in results["runs"]:
        if run.get("kind") != "dptrain" or run["workers"] < 2:
            continue
        run_dir = Path(run["run_dir"])
        run_dir = run_dir if run_dir.is_absolute() else bench / run_dir
        summary = json.loads((run_dir / "summary.json").read_text())
        choice = summary["strategy_options"].get("auto")
        if choice:
            autos.append({"run": run_dir.name, "chosen": choice["chosen"], "epoch_seconds": run["epoch_seconds"],
                          "predicted_epoch_seconds": choice["predicted_epoch_seconds"],
                          "bandwidth_mbit_per_second": choice["measured"]["bandwidth_bytes_per_second"] * 8 / 1e6,
                          "latency_us": choice["measured"]["latency_seconds"] * 1e6,
                          "us_per_sample": choice["measured"]["seconds_per_sample"] * 1e6})
        else:
            measured.setdefault(run["strategy"], []).append(run["epoch_seconds"])
    medians = {strategy: statistics.median(times) for strategy, times in measured.items()}
    fastest = min(medians, key=medians.get) if medians else None
    for auto in autos:
        chosen = LABELS.get(auto["chosen"])
        auto["picked_the_measured_fastest"] = chosen == fastest
        # auto keeps allreduce when it is predicted at most 5 % slower (dptrain.strategies.auto.TOLERANCE)
        auto["within_tolerance_of_the_measured_fastest"] = chosen in medians and medians[chosen] <= 1.05 * medians[fastest]
    return {"network": results.get("network", {}).get("name", "loopback"), "measured_median_epoch_seconds": medians,
            "measured_fastest": fastest, "auto_runs": autos}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", help="a dptrain bench output directory")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    report = decisions(Path(args.bench))
    print(f"{report['network']}: measured median epoch (s) of the direct runs: "
          + ", ".join(f"{k} {v:.3f}" for k, v in report["measured_median_epoch_seconds"].items())
          + f"; fastest: {report['measured_fastest']}")
    for auto in report["auto_runs"]:
        predicted = ", ".join(f"{k} {v:.3f}" for k, v in auto["predicted_epoch_seconds"].items())
        print(f"  {auto['run']}: chose {auto['chosen']} (predicted {predicted}; measured link "
              f"{auto['bandwidth_mbit_per_second']:.1f} Mbit/s, {auto['latency_us']:.0f} us, {auto['us_per_sample']:.0f} us "
              f"per sample); its own epochs {auto['epoch_seconds']:.3f} s; matches the measured fastest: "
              f"{auto['picked_the_measured_fastest']}"
              + ("" if auto["picked_the_measured_fastest"] else
                 f" (within 5 % of it: {auto['within_tolerance_of_the_measured_fastest']})"))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
