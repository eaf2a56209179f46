"""Fault injection: kill a random worker at a random moment; the run must restart and finish as well.

    make test PYTEST_ARGS="tests/test_fault_injection.py --fault-runs 20 --fault-report faults.jsonl"

Each run trains digits with 2 workers under `--max-restarts 3`, while a killer SIGKILLs one
randomly chosen worker at a random moment: after a random number of epochs (0: during start-up
or the first epoch, before any checkpoint), plus a random fraction of an epoch. Recorded per run: completed, restarts,
epochs lost (trained but thrown away because they came after the last checkpoint) and final
test accuracy, which must be within 1 point of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_train_cli import DIGITS

pytestmark = [pytest.mark.slow]
EPOCHS = 8


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _kill_later(launcher: subprocess.Popen, rank: int, after_epochs: int, extra_delay: float, metrics: Path,
                killed: dict) -> None:
    """SIGKILL worker `rank` once rank 0 has recorded `after_epochs` epochs, plus a random moment.

    after_epochs 0 means during start-up or the first epoch (before any checkpoint exists).
    """
    deadline = time.monotonic() + 120
    while launcher.poll() is None and time.monotonic() < deadline:
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if done >= after_epochs and len(_children(launcher.pid)) == 2:
            time.sleep(extra_delay)
            for pid in _children(launcher.pid):
                if _rank_of(pid) == rank:
                    os.kill(pid, signal.SIGKILL)
                    killed.update(pid=pid, after_epochs=done)
                    return
        time.sleep(0.01)


def _train(cwd: Path, out: str, strategy: str, extra=()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dptrain", "train", *DIGITS, "--epochs", str(EPOCHS),
                             "--strategy", strategy, "--out", out, *extra],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def reference_accuracy(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("reference")
    proc = _train(cwd, "clean", "sync")
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr
    return json.loads((cwd / "clean" / "summary.json").read_text())["test_accuracy"]


@pytest.mark.timeout(3600)  # --fault-runs 20 takes minutes; each run has its own 300 s limit
def test_killed_workers_are_restarted_and_the_run_finishes_as_well(tmp_path, request, reference_accuracy):
    runs = request.config.getoption("--fault-runs")
    report_path = request.config.getoption("--fault-report")
    rng = random.Random(int(os.environ.get("DPTRAIN_FAULT_SEED", "0")))
    results = []
    for index in range(runs):
        rank, after_epochs = rng.randrange(2), rng.randrange(EPOCHS - 1)
        delay = rng.uniform(0.5, 3.0) if after_epochs == 0 else rng.uniform(0.0, 0.1)  # an epoch takes ~0.1 s
        launcher = _train(tmp_path, f"run{index}", "sync", ["--max-restarts", "3"])
        killed: dict = {}
        metrics = tmp_path / f"run{index}" / "metrics.jsonl"
        killer = threading.Thread(target=_kill_later, args=(launcher, rank, after_epochs, delay, metrics, killed),
                                  daemon=True)
        killer.start()
        stdout, stderr = launcher.communicate(timeout=300)
        killer.join()
        epochs_printed = len(re.findall(r"^\[rank0\] epoch \d+/", stdout, re.M))
        summary_path = tmp_path / f"run{index}" / "summary.json"
        accuracy = json.loads(summary_path.read_text())["test_accuracy"] if summary_path.exists() else None
        result = {"run": index, "victim_rank": rank, "killed_after_epochs": killed.get("after_epochs"),
                  "extra_delay_s": round(delay, 2), "killed": bool(killed),
                  "completed": launcher.returncode == 0, "restarts": stderr.count("restarting the 2 workers"),
                  "epochs_lost": epochs_printed - EPOCHS, "test_accuracy": accuracy,
                  "reference_accuracy": reference_accuracy}
        results.append(result)
        print(json.dumps(result))
        if result["restarts"] > 1:  # a restart that itself failed: keep its story in the log
            print(stderr[-3000:])
        assert result["completed"], stderr[-2000:]
        assert abs(accuracy - reference_accuracy) <= 0.01
        if killed:  # the worker may have finished before its time came
            assert result["restarts"] >= 1 and f"worker rank {rank} was killed by SIGKILL" in stderr, stderr[-3000:]
    if report_path:
        Path(report_path).write_text("".join(json.dumps(r) + "\n" for r in results))
