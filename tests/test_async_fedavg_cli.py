"""`dptrain train --strategy async|fedavg` end to end with the local launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dptrain.train.recorder import Summary, summary_line
from test_train_cli import DIGITS, dptrain, misbehave

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("strategy,extra", [("async", []), ("fedavg", ["--partition", "iid"])])
def test_two_workers_reach_90_percent_on_digits(tmp_path, strategy, extra):
    result = dptrain("train", *DIGITS, "--strategy", strategy, *extra, "--workers", "2", "--out", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.90
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 10
    assert all(len(record["workers"]) == 2 for record in records)  # every worker's numbers, per epoch
    # What is printed is what is recorded: the last line is summary.json's, and an async epoch line,
    # printed before the other rank's numbers exist, says whose numbers it shows.
    assert result.stdout.splitlines()[-1] == summary_line(Summary.from_dict(summary), Path("run"))
    epoch_lines = [line for line in result.stdout.splitlines() if line.startswith("[rank0] epoch ")]
    assert len(epoch_lines) == 10
    assert all(line.endswith("(rank 0 alone)") == (strategy == "async") for line in epoch_lines)
    if strategy == "async":
        assert summary["merges"] == [10, 10] and summary["max_staleness_seen"] >= 0
    else:
        assert summary["rounds"] == 10 and sum(summary["partition_sizes"]) == 1437


def test_a_frozen_worker_during_async_is_named_instead_of_a_hang(tmp_path):
    result = misbehave(tmp_path, "stop", "--strategy", "async", "--timeout", "6", "--out", "frozen")
    assert result.returncode != 0
    assert "rank 1 stopped responding" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "frozen" / "summary.json").exists()
