"""Pre-emption under every strategy: a stop signal, whenever it comes, ends the run with a complete
checkpoint and exit code 75 on every rank, and the same command continues it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dptrain.train import checkpoint_files
from test_train_cli import DIGITS
from cli_runner import ForkedDptrain, run_dptrain
from launcher_signals import signal_when_started

STRATEGIES = ("allreduce", "sync", "async", "fedavg")


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# Each strategy with another of the stop signals a scheduler may send (SLURM --signal, PBS, Kubernetes).
@pytest.mark.parametrize("strategy, stop", list(zip(STRATEGIES, ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGUSR2"))))
def test_a_stop_signal_while_the_workers_start_up_ends_the_run_after_epoch_1(tmp_path, strategy, stop):
    proc = ForkedDptrain(["train", *DIGITS, "--epochs", "3", "--strategy", strategy, "--out", "run"], cwd=tmp_path)
    deadline = time.monotonic() + 60
    while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = _children(proc.pid)
    assert len(workers) == 2
    # At once, while the interpreters themselves start: the launcher starts its workers with stop
    # signals blocked, and a worker unblocks them once it remembers them (dptrain.runtime.prestart).
    for pid in workers:  # as SLURM signals every task
        os.kill(pid, signal.Signals[stop])
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 75, stderr
    assert stderr.count(f"stopped by {stop}") >= 1, stderr
    assert stderr.count("stopped by") + stderr.count("another rank stopped") == 2, stderr
    assert checkpoint_files.latest_complete(tmp_path / "run", 2)[0] == 1


@pytest.mark.parametrize("extra", [0.0, 0.1, 0.3, 0.6], ids=lambda s: f"{s:g}s-after-the-first-rank")
def test_a_stop_signal_to_the_launcher_while_it_starts_stops_every_rank_in_one_line(tmp_path, extra):
    argv = ["train", *DIGITS, "--workers", "2", "--epochs", "1", "--out", "run"]
    ended = signal_when_started(argv, tmp_path, extra)

    assert ended["left"] == [], ended  # every rank it started was gone when it exited
    assert ended["code"] == 75, ended  # as for a stop signal after the start (checkpoint, then 75)
    assert "Traceback" not in ended["stderr"]
    said = [line for line in ended["stderr"].splitlines() if "stopped by SIGTERM" in line]
    if said and not said[0].startswith("[rank"):  # before the ranks had work: the launcher's one line
        assert said == ["dptrain: stopped by SIGTERM while the workers were starting: stopped them before they "
                        "began training; the same command again starts the run (or continues it from its last "
                        "checkpoint)"], ended
    else:  # they had their work: each honoured it with a checkpoint
        assert len(said) == 2 and all("a checkpoint is saved" in line for line in said), ended
    if extra == 0.0:  # what it left in the run directory does not stand in the way of the same command
        again = subprocess.run([sys.executable, "-m", "dptrain", *argv], cwd=tmp_path, capture_output=True,
                               text=True, timeout=180)
        assert again.returncode == 0, again.stderr


_SWALLOWED = """
import os, signal
from dptrain.errors import StoppedStarting
from dptrain.runtime.launcher import raise_if_stopped_while_starting, stop_while_starting
stop_while_starting()
try:  # as library code may (seen: numpy's Cython module initialisation, during an import): the exception is lost
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(1000):
        pass
except BaseException:
    pass
else:
    raise SystemExit("the handler raised nothing")
try:
    raise_if_stopped_while_starting()
except StoppedStarting as exc:
    print(exc)
"""


def test_a_stop_signal_whose_exception_library_code_swallowed_is_raised_again_before_the_ranks_get_work():
    # The launcher's run-through: the stop is remembered, and launch_local raises it again before releasing
    # the ranks (a SIGTERM 0.3 s after the start, during numpy's import, once trained the whole run and exited 0).
    done = subprocess.run([sys.executable, "-c", _SWALLOWED], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("stopped by SIGUSR1 while the workers were starting"), done.stdout


@pytest.mark.slow
def test_async_stops_every_rank_with_a_checkpoint_before_the_store_goes_and_continues(tmp_path):
    # Rank 1 is a 3x straggler: when the signal comes, rank 0 is epochs ahead and must keep the
    # store and the merge service up until rank 1 has checkpointed too.
    args = ["train", *DIGITS, "--epochs", "12", "--strategy", "async", "--slow-worker", "1:3", "--out", "run"]
    proc = ForkedDptrain(args, cwd=tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # the launcher passes it on to both ranks
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 75, stderr
    assert "Connection closed" not in stderr and "PeerFailure" not in stderr, stderr
    assert stderr.count("[rank0] dptrain: rank 0: stopped by SIGTERM") == 1, stderr
    assert stderr.count("[rank1] dptrain: rank 1: stopped by SIGTERM") == 1, stderr
    stopped_at = checkpoint_files.latest_complete(tmp_path / "run", 2)[0]
    assert stopped_at is not None and stopped_at < 12
    again = run_dptrain(args, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"resuming after epoch {stopped_at}" in again.stdout
    assert [r["epoch"] for r in _records(tmp_path / "run")] == list(range(1, 13))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["epochs"] == 12 and summary["test_accuracy"] >= 0.85


@pytest.mark.parametrize("workers", ["1", "2"])
def test_ctrl_c_says_after_which_epoch_in_one_line_and_the_same_command_continues(tmp_path, workers):
    args = [sys.executable, "-m", "dptrain", "train", *DIGITS, "--epochs", "1000", "--workers", workers,
            "--no-progress", "--out", "run"]
    # As a terminal does: SIGINT to the whole process group (launcher and workers), default handling.
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
            (tmp_path / "run" / "metrics.jsonl").exists() and len(_records(tmp_path / "run")) >= 2):
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    done = len(_records(tmp_path / "run"))
    saved, _ = checkpoint_files.latest_complete(tmp_path / "run", int(workers))
    assert saved is not None and saved in (done - 1, done)  # the Ctrl-C may cut the save of the last epoch
    said = [line for line in stderr.splitlines() if "interrupted" in line]
    assert said == [f"dptrain: interrupted after epoch {done} of 1000; the same command again continues from the "
                    f"checkpoint of epoch {saved}"], stderr
    assert "Traceback" not in stderr

    args[args.index("1000")] = str(saved + 2)
    again = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"resuming after epoch {saved}" in again.stdout
    assert [record["epoch"] for record in _records(tmp_path / "run")] == list(range(1, saved + 3))
