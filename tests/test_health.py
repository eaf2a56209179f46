"""The check of every average, the collapse line, the 10x divergence check and --lr-scaling auto's guard
(dptrain.train.health, issue 20)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dptrain.config import TrainConfig
from dptrain.train.health import COLLAPSE_RATIO, AverageCheck, AverageHealth, LRGuard, probe_rows
from dptrain.lr_policy import build_schedule
from cli_runner import run_dptrain

HERE = Path(__file__).parent


def _dptrain(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    shutil.copy(HERE / "blobs_factory.py", tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # --lr 0.05: the default of the report (0.02 since)
    return run_dptrain(["train", "--data", "blobs_factory:make", "--model", "mlp", "--lr", "0.05", "--no-progress",
                        *args], cwd=tmp_path, env=env, timeout=timeout)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _check(bad: bool, epoch: int = 1) -> AverageCheck:
    return AverageCheck(epoch, 1.0, 2.0 if bad else 0.5, None, None, None, bad, "why" if bad else "")


def test_probe_rows_are_fixed_disjoint_and_bounded():
    rows = [probe_rows(10_000, rank, 4, seed=3) for rank in range(4)]
    assert rows == [probe_rows(10_000, rank, 4, seed=3) for rank in range(4)]
    assert all(len(r) == 256 for r in rows)
    assert len(set().union(*map(set, rows))) == 4 * 256
    small = probe_rows(40, 1, 4, seed=0)
    assert len(small) == 10 and all(0 <= i < 40 for i in small)


def test_collapse_needs_two_bad_averages_in_a_row():
    health = AverageHealth.__new__(AverageHealth)
    health.streak, health.collapses = 0, 0
    said = [health.verdict(_check(bad, epoch)) for epoch, bad in
            enumerate([True, False, True, True, True, False, True, True], start=1)]
    assert [line is not None for line in said] == [False, False, False, True, False, False, False, True]
    assert "epoch 4" in said[3] and "--lr-scaling none" in said[3]
    assert health.collapses == 2


def test_lr_guard_halves_the_scale_down_to_one_and_restores_the_last_good_average():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9)
    scheduler = build_schedule(optimizer, steps_per_epoch=10, epochs=5)
    guard = LRGuard(4.0, restore=True, log=lambda line: None)
    guard.keep(model)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    assert guard.judge(AverageCheck(1, 1.0, 0.8, None, None, None, False), model, optimizer, scheduler) is None
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    assert optimizer.state  # momentum exists
    event = guard.judge(AverageCheck(2, 1.0, 3.0, None, None, None, True, "worse"), model, optimizer, scheduler)
    assert event == {"epoch": 2, "from_scale": 4.0, "to_scale": 2.0, "restored": True, "reason": "bad average"}
    assert all(torch.equal(model.state_dict()[k], good[k]) for k in good)
    assert not optimizer.state and scheduler.base_lrs == [pytest.approx(0.2)]
    # A rise over the best average's loss also backs off; the scale never goes below 1 (the user's --lr).
    assert guard.judge(AverageCheck(3, 1.0, 0.8 * 1.3, None, None, None, False), model, optimizer, scheduler)["to_scale"] == 1
    assert not guard.active
    assert guard.judge(AverageCheck(4, 1.0, 9.0, None, None, None, True), model, optimizer, scheduler) is None
    assert scheduler.base_lrs == [pytest.approx(0.1)]


def test_auto_scales_only_where_the_guard_can_act():
    def rule(**settings):
        return TrainConfig(workers=4, **{"lr_scaling": "auto", **settings}).lr_scale(4)
    assert rule(strategy="sync") == (4.0, "auto")
    assert rule(strategy="async") == (4.0, "auto")
    assert rule(strategy="fedavg") == (4.0, "auto")
    assert rule(strategy="fedavg", partition="dirichlet") == (1.0, "none")
    assert rule(strategy="sync", sync_every_steps=1) == (1.0, "none")  # step for step allreduce: keeps --lr
    assert rule(strategy="streaming") == (1.0, "none")
    assert rule(strategy="allreduce") == (1.0, "none")
    assert rule(strategy="sync", lr_scaling="linear") == (4.0, "linear")
    assert TrainConfig(strategy="sync").lr_scale(4) == (1.0, "none")  # the default keeps --lr


def test_lr_defaults_per_optimizer():
    assert TrainConfig().lr == 0.02
    assert TrainConfig(optimizer="adam").lr == 0.01
    assert TrainConfig(optimizer="adamw").lr == 0.01
    assert TrainConfig(optimizer="adam", lr=0.01).lr == 0.01


@pytest.mark.slow
def test_collapse_line_on_the_user_dataset_and_stop_on_collapse(tmp_path):
    """Issue 20's user Dataset under sync with the LR scaled by W unguarded (the previous default's rule):
    training goes backwards; the line names the epoch and the fixes, and metrics.jsonl records it."""
    args = ["--strategy", "sync", "--workers", "4", "--epochs", "10", "--lr-scaling", "linear", "--seed", "0"]
    done = _dptrain(tmp_path, *args, "--out", "run")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if "averaging collapses" in line]
    assert len(lines) == 1 and "in epoch 8" in lines[0] and "--lr-scaling none" in lines[0]
    records = _records(tmp_path / "run")
    assert [r["epoch"] for r in records if r.get("collapse")] == [8]
    checks = [r["average_check"] for r in records]
    assert len(checks) == 10 and all(c["chance"] is not None for c in checks)
    assert checks[7]["bad"] and checks[6]["bad"]
    best = min(c["average_loss"] for c in checks[:7])
    assert checks[7]["average_loss"] > COLLAPSE_RATIO * best

    stopped = _dptrain(tmp_path, *args, "--stop-on-collapse", "--out", "stopped")
    assert stopped.returncode == 2
    assert "stopped by --stop-on-collapse" in stopped.stderr and "Traceback" not in stopped.stderr
    assert len(_records(tmp_path / "stopped")) == 8


@pytest.mark.slow
def test_auto_backs_off_restoring_the_previous_average_exactly(tmp_path):
    """Default auto on 8 workers: backs off; where it restores, the epoch's global model is the previous one."""
    done = _dptrain(tmp_path, "--strategy", "sync", "--workers", "8", "--epochs", "6", "--seed", "0",
                    "--lr-scaling", "auto", "--out", "run")
    assert done.returncode == 0, done.stderr
    records = _records(tmp_path / "run")
    backoffs = [r["lr_backoff"] for r in records if "lr_backoff" in r]
    assert backoffs and [b["to_scale"] for b in backoffs] == [8 / 2 ** (i + 1) for i in range(len(backoffs))]
    assert "backs off" in done.stdout
    for before, record in zip(records, records[1:]):
        if record.get("lr_backoff", {}).get("restored"):
            assert record["test_loss"] == before["test_loss"] and record["test_accuracy"] == before["test_accuracy"]
    # The LR the run used afterwards is the backed-off one (warm-up over by then).
    assert records[-1]["lr"] == pytest.approx(0.05 * backoffs[-1]["to_scale"])
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["test_accuracy"] > 0.8


@pytest.mark.slow
def test_loss_ten_times_its_first_is_divergence(tmp_path):
    done = _dptrain(tmp_path, "--strategy", "sync", "--workers", "4", "--epochs", "6", "--lr", "0.5",
                    "--lr-scaling", "none", "--out", "run")
    assert done.returncode == 2
    assert "more than 10x the first epoch's" in done.stderr and "Traceback" not in done.stderr
    records = _records(tmp_path / "run")
    assert all(math.isfinite(r["train_loss"]) for r in records)
    assert records[-1]["train_loss"] > 10 * records[0]["train_loss"]


def test_lr_guard_recovers_from_divergence_only_while_it_can():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.8)
    guard = LRGuard(8.0, restore=True, log=lambda line: None)
    assert not guard.can_recover  # nothing kept yet
    guard.keep(model)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    assert guard.can_recover
    event = guard.recover(3, model, optimizer, None)
    assert event == {"epoch": 3, "from_scale": 8.0, "to_scale": 4.0, "restored": True, "reason": "training diverged"}
    assert all(torch.equal(model.state_dict()[k], good[k]) for k in good)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4)
    assert not LRGuard(8.0, restore=False, log=print).can_recover  # async, an outer optimizer: cannot take it back
