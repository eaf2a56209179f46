"""Fault injection: kill a random worker at a random moment; the run must restart and finish as well.

    make test PYTEST_ARGS="tests/test_fault_injection.py --fault-runs 20 --fault-report faults.jsonl"

Each run trains digits with 2 workers under `--max-restarts 3`, while a killer SIGKILLs one
randomly chosen worker process after a random delay. Recorded per run: completed, restarts,
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


def _kill_later(launcher: subprocess.Popen, rank: int, delay: float, killed: dict) -> None:
    time.sleep(delay)
    for pid in _children(launcher.pid):
        if _rank_of(pid) == rank:
            os.kill(pid, signal.SIGKILL)
            killed.update(pid=pid, at=delay)
            return


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


def test_killed_workers_are_restarted_and_the_run_finishes_as_well(tmp_path, request, reference_accuracy):
    runs = request.config.getoption("--fault-runs")
    report_path = request.config.getoption("--fault-report")
    rng = random.Random(int(os.environ.get("DPTRAIN_FAULT_SEED", "0")))
    results = []
    for index in range(runs):
        rank, delay = rng.randrange(2), rng.uniform(3.0, 7.0)  # workers take ~3 s to start on 2 cores
        launcher = _train(tmp_path, f"run{index}", "sync", ["--max-restarts", "3"])
        killed: dict = {}
        killer = threading.Thread(target=_kill_later, args=(launcher, rank, delay, killed), daemon=True)
        killer.start()
        stdout, stderr = launcher.communicate(timeout=300)
        killer.join()
        epochs_printed = len(re.findall(r"^\[rank0\] epoch \d+/", stdout, re.M))
        summary_path = tmp_path / f"run{index}" / "summary.json"
        accuracy = json.loads(summary_path.read_text())["test_accuracy"] if summary_path.exists() else None
        result = {"run": index, "victim_rank": rank, "kill_after_s": round(delay, 2), "killed": bool(killed),
                  "completed": launcher.returncode == 0, "restarts": stderr.count("restarting the 2 workers"),
                  "epochs_lost": epochs_printed - EPOCHS, "test_accuracy": accuracy,
                  "reference_accuracy": reference_accuracy}
        results.append(result)
        print(json.dumps(result))
        assert result["completed"], stderr[-2000:]
        assert abs(accuracy - reference_accuracy) <= 0.01
        if killed:  # the worker may have finished before its time came
            assert result["restarts"] == 1 and f"worker rank {rank} was killed by SIGKILL" in stderr
    if report_path:
        Path(report_path).write_text("".join(json.dumps(r) + "\n" for r in results))
