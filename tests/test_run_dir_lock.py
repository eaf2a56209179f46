"""One run per run directory: a second run is refused naming the holder; a dead holder's lock is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from dptrain.runtime.env import free_port
from dptrain.train.rundir import LOCK_FILE
from test_store_deadlines import wait_for
from test_train_cli import dptrain
from cli_runner import ForkedDptrain

pytestmark = pytest.mark.slow


def train_argv(out: Path, epochs: int, workers: int = 2) -> list[str]:
    return ["train", "--dataset", "digits", "--workers", str(workers), "--epochs", str(epochs), "--out", str(out)]


def start(argv: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    return ForkedDptrain(argv, cwd=cwd, env={**os.environ, **(env or {})}, new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM asks the launcher's workers to checkpoint and stop; whatever is left is killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_two_runs_started_together_one_is_refused_naming_the_other(tmp_path):
    out = tmp_path / "run"
    runs = [start(train_argv(out, 500), tmp_path) for _ in range(2)]
    try:
        deadline = time.monotonic() + 180
        while all(run.poll() is None for run in runs):
            assert time.monotonic() < deadline, "neither run was refused"
            time.sleep(0.1)
        refused = next(run for run in runs if run.poll() is not None)
        holder = next(run for run in runs if run is not refused)
        stderr = refused.stderr.read()
        assert refused.returncode == 2, stderr
        assert "Traceback" not in stderr
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("dptrain: error: "), stderr
        assert f"'{out}' is in use by another dptrain run (PID {holder.pid} on host {socket.gethostname()})" in lines[0]
        # SIGTERM is honoured from the first epoch end on (a worker still importing dies of it).
        wait_for(lambda: (out / "metrics.jsonl").exists(), 180, "first epoch of the holder")
        assert holder.poll() is None
    finally:
        for run in runs:
            stop(run)
    assert holder.returncode == 75, holder.stderr.read()  # stopped by our SIGTERM, after a checkpoint
    epochs = [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, len(epochs) + 1))  # one run's records, not two interleaved
    assert not (out / LOCK_FILE).exists()


def test_a_rank_started_by_another_launcher_is_refused_too(tmp_path):
    """Under torchrun/srun/mpirun rank 0 takes the lock; here a one-rank world started by hand."""
    out = tmp_path / "run"
    holder = start(train_argv(out, 500), tmp_path)
    try:
        wait_for(lambda: (out / "metrics.jsonl").exists(), 180, "first epoch of the holder")
        rank = dptrain(*train_argv(out, 500, workers=1), cwd=tmp_path, timeout=180,
                       env={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(free_port()), "DPTRAIN_DEBUG": "0"})
        assert rank.returncode == 2, rank.stderr
        lines = rank.stderr.splitlines()
        assert len(lines) == 1 and f"(PID {holder.pid} on host {socket.gethostname()})" in lines[0], rank.stderr
        assert holder.poll() is None
    finally:
        stop(holder)


def test_a_lock_left_by_a_dead_run_is_taken_over_with_a_note(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # its PID names a process that no longer runs
    (out / LOCK_FILE).write_text(f"{gone.pid} {socket.gethostname()}\n")

    result = dptrain(*train_argv(out, 1), cwd=tmp_path, timeout=180)

    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "taking over" in line]
    assert len(notes) == 1 and f"PID {gone.pid} on host {socket.gethostname()}" in notes[0], result.stderr
    assert (out / "summary.json").exists() and not (out / LOCK_FILE).exists()
