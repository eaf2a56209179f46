"""Every wait on another process has a deadline, calls to the rendezvous store included.

Real 2-worker runs and hand-started ranks on 127.0.0.1. Rank 0 hosts the store; when it is
frozen (SIGSTOP) the other rank must still fail within its --timeout plus the store's deadline
and name rank 0, and a rank whose MASTER_PORT is served by something else must say so in time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train_cli import dptrain

pytestmark = pytest.mark.slow


def worker_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the local launcher's workers, from their RANK variable."""
    found = {}
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    for pid in map(int, children):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next(item[5:] for item in env if item.startswith(b"RANK="))
        found[int(rank)] = pid
    return found


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def test_a_frozen_rank_0_is_named_within_the_timeout_although_it_hosts_the_store(tmp_path):
    out, timeout = tmp_path / "run", 8
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--workers", "2", "--epochs", "500",
         "--strategy", "sync", "--timeout", str(timeout), "--out", str(out)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: dict[int, int] = {}
    try:
        wait_for(lambda: (out / "metrics.jsonl").exists(), 180, "first epoch")
        pids = worker_pids(launcher)
        os.kill(pids[0], signal.SIGSTOP)
        frozen = time.monotonic()
        _, stderr = launcher.communicate(timeout=timeout + 20)
        took = time.monotonic() - frozen
    finally:
        for pid in pids.values():  # SIGKILL works on a stopped process; SIGCONT in case it outlived the launcher
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode != 0
    rank1 = [line for line in stderr.splitlines() if line.startswith("[rank1] dptrain: error: ")]
    assert len(rank1) == 1, stderr
    assert "rank 0 (the rendezvous store's host) does not answer" in rank1[0], stderr
    assert "Traceback" not in stderr
    print(f"frozen rank 0 named after {took:.1f} s (timeout {timeout} s)")
