"""benchmarks/accuracy.py: the commands it runs, and the statistics and table it reports from finished runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import accuracy  # noqa: E402 - the benchmark script, imported as a module


def _flags(cmd: list[str]) -> dict[str, str]:
    args = cmd[cmd.index("train") + 1:]
    return {flag: value for flag, value in zip(args, args[1:] + [""]) if flag.startswith("--")}


def test_commands_carry_the_benchmark_the_configuration_and_the_worker_count(tmp_path):
    flags = _flags(accuracy.command("mnist1d-adam", 150, "sync-e1-sum", 4, 2, tmp_path))
    assert flags["--dataset"] == "mnist1d" and flags["--model"] == "cnn1d" and flags["--optimizer"] == "adam"
    assert (flags["--lr"], flags["--batch-size"], flags["--epochs"]) == ("0.01", "100", "150")
    assert (flags["--strategy"], flags["--workers"], flags["--seed"]) == ("sync", "4", "2")
    assert (flags["--outer"], flags["--outer-lr"], flags["--outer-momentum"]) == ("nesterov", "4", "0")
    assert flags["--checkpoint-every"] == "0" and flags["--out"] == str(tmp_path)
    # The sqrt(W) configuration rewrites the benchmark's learning rate: 0.05 * sqrt(4) = 0.1.
    sgd = _flags(accuracy.command("mnist1d-sgd", 60, "sync-e1-sqrt-lr", 4, 0, tmp_path))
    assert sgd["--lr"] == "0.1" and "__lr_times__" not in accuracy.command("mnist1d-sgd", 60, "sync-e1-sqrt-lr", 4,
                                                                             0, tmp_path)


def _finished(runs: Path, config: str, workers: int, seed: int, curve: list[float] | None) -> None:
    out = accuracy.run_dir(runs, "mnist1d-adam", 3, config, workers, seed)
    out.mkdir(parents=True)
    meta = {"bench": "mnist1d-adam", "config": config, "workers": workers, "seed": seed, "epochs": 3,
            "command": ["x"], "returncode": 0 if curve else 1, "seconds": 1.0}
    if curve is None:
        meta["error"] = "training diverged in epoch 2"
    else:
        (out / "summary.json").write_text(json.dumps({"test_accuracy": curve[-1], "test_loss": 0.5,
                                                      "wall_seconds": 2.0, "comm_bytes": 10}))
        (out / "metrics.jsonl").write_text("".join(
            json.dumps({"epoch": i + 1, "test_accuracy": a, "train_loss": 1.0 / (i + 1)}) + "\n"
            for i, a in enumerate(curve)))
    (out / "accuracy_run.json").write_text(json.dumps(meta))


def test_the_report_gives_mean_std_and_the_difference_to_one_worker_and_counts_failed_runs(tmp_path):
    runs = tmp_path / "runs"
    _finished(runs, "one-worker", 1, 0, [0.5, 0.8, 0.90])
    _finished(runs, "one-worker", 1, 1, [0.5, 0.8, 0.92])
    _finished(runs, "sync-e1", 2, 0, [0.4, 0.7, 0.85])
    _finished(runs, "sync-e1", 2, 1, [0.4, 0.7, 0.89])
    _finished(runs, "sync-e1", 2, 2, None)
    _finished(runs, "sync-e1", 4, 1, [0.3, 0.6, 0.95])
    accuracy.report(runs, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = {(r["config"], r["workers"]): r for r in saved["summary"]}
    assert rows[("one-worker", 1)]["mean"] == pytest.approx(0.91)
    assert rows[("one-worker", 1)]["std"] == pytest.approx(0.0141421356)  # sample std of 0.90, 0.92
    assert rows[("sync-e1", 2)]["mean"] == pytest.approx(0.87) and rows[("sync-e1", 2)]["failed"] == 1
    assert rows[("sync-e1", 2)]["seeds"] == [0, 1, 2]
    one = next(r for r in saved["runs"] if r["config"] == "one-worker" and r["seed"] == 1)
    assert one["curve"] == [[1, 0.5, 1.0], [2, 0.8, 0.5], [3, 0.92, pytest.approx(1 / 3)]]
    table = (tmp_path / "out" / "mnist1d-adam-3ep.md").read_text()
    assert "| one-worker | 1 | 0.9100 ± 0.0141 |  |  | 2 | 0 |" in table
    # paired: ((0.85 - 0.90) + (0.89 - 0.92)) / 2 = -0.04; seed 1 only: 0.95 - 0.92 = +0.03 (unpaired: +0.04)
    assert "| sync-e1 | 2 | 0.8700 ± 0.0283 | -4.0 | -4.0 | 2 | 1 |" in table
    assert "| sync-e1 | 4 | 0.9500 ± 0.0000 | +4.0 | +3.0 | 1 | 0 |" in table
    assert (tmp_path / "out" / "mnist1d-adam-3ep.png").stat().st_size > 0
