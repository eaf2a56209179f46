"""The cost model against committed measurements: the numbers of benchmarks/README.md section 16.

    PYTHONPATH=src .venv/bin/python benchmarks/costmodel_check.py

1. results/100mbit and results/100mbit-wide (allreduce and sync, 2 workers): compute per sample
   calibrated from the 1-worker runs, so both 2-worker rows are independent predictions.
2. results/streaming/* (sync, streaming, allreduce at 100 Mbit/s): compute per sample calibrated
   from the sync runs of the same bench (with their --sync-every-steps), then streaming predicted
   with the overlapped-average formula and its --sync-every-steps / --overlap-steps.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from dptrain import costmodel
from dptrain.costmodel import Calibration, Settings

RESULTS = Path(__file__).resolve().parent / "results"


def load(name: str) -> dict:
    return json.loads((RESULTS / name / "results.json").read_text())


def link(bench: dict, first: dict) -> Calibration:
    net = bench["network"]
    return Calibration(seconds_per_sample=0.0, model_bytes=4 * first["model_parameters"],
                       bandwidth=net["bandwidth_bytes_per_second"], latency=net["round_trip_seconds"] / 2,
                       samples=first["train_samples"], batch_size=first["batch_size"])


def row(name: str, strategy: str, measured: list[float], cal: Calibration, settings: Settings = Settings()) -> dict:
    mean = statistics.mean(measured)
    predicted = costmodel.epoch_seconds(strategy, 2, cal, settings=settings)["total"]
    return {"bench": name, "strategy": strategy, "measured_epoch_seconds": mean, "predicted_epoch_seconds": predicted,
            "error": (predicted - mean) / mean, "seconds_per_sample": cal.seconds_per_sample}


def from_one_worker(name: str) -> list[dict]:
    bench = load(name)
    runs = [r for r in bench["runs"] if r.get("kind", "dptrain") == "dptrain"]
    cal = costmodel.calibrate([r for r in runs if r["workers"] == 1 and r["strategy"] == "allreduce"], bench["network"])
    return [row(name, strategy, [r["epoch_seconds"] for r in runs if r["workers"] == 2 and r["strategy"] == strategy], cal)
            for strategy in ("allreduce", "sync")]


def streaming(name: str, sync_from: str) -> list[dict]:
    bench, source = load(name), load(sync_from)
    train = bench["train"]
    settings = Settings(every_steps=train.get("sync_every_steps"), delay_steps=train.get("overlap_steps"))
    base = link(bench, bench["runs"][0])
    sync_comm = costmodel.epoch_seconds("sync", 2, base, settings=Settings(every_steps=settings.every_steps))["communication"]
    syncs = [r for r in source["runs"] if r["strategy"] == "sync" and r["workers"] == 2]
    per_sample = statistics.median((r["epoch_seconds"] - sync_comm) / costmodel.shard_samples(r["train_samples"], 2)
                                   for r in syncs)
    cal = Calibration(**{**base.as_dict(), "seconds_per_sample": per_sample})
    rows = []
    for strategy in ("allreduce", "streaming"):
        measured = [r["epoch_seconds"] for r in bench["runs"] if r["strategy"] == strategy and r["workers"] == 2]
        if measured:
            rows.append(row(name, strategy, measured, cal, settings if strategy == "streaming" else Settings()))
    return rows


def main() -> None:
    rows = from_one_worker("100mbit") + from_one_worker("100mbit-wide")
    rows += streaming("streaming/cnn", "streaming/cnn") + streaming("streaming/cnn-k4", "streaming/cnn-k4")
    rows += streaming("streaming/wide", "streaming/wide") + streaming("streaming/wide-d4", "streaming/wide")
    for r in rows:
        print(f"{r['bench']:18s} {r['strategy']:9s} measured {r['measured_epoch_seconds']:.3f} s  predicted "
              f"{r['predicted_epoch_seconds']:.3f} s  error {r['error'] * 100:+.1f} %  "
              f"({r['seconds_per_sample'] * 1e6:.0f} us per sample)")


if __name__ == "__main__":
    main()
