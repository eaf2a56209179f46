"""Every wait on another process has a deadline, calls to the rendezvous store included.

Real 2-worker runs and hand-started ranks on 127.0.0.1. Rank 0 hosts the store; when it is
frozen (SIGSTOP) the other rank must still fail within its --timeout plus the store's deadline
and name rank 0, and a rank whose MASTER_PORT is served by something else must say so in time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
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


class ForeignServer:
    """A plain TCP server on 127.0.0.1 that is not a torch.distributed store: it accepts and stays
    silent, or answers every connection with a line of HTTP."""

    def __init__(self, answer: bool) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.answer, self.connections = answer, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            self.connections.append(connection)
            if self.answer:
                connection.sendall(b"HTTP/1.0 200 OK\r\n\r\nhello\n")

    def close(self) -> None:
        for connection in self.connections:
            connection.close()
        self.socket.close()


@pytest.mark.parametrize("answer", [False, True], ids=["silent", "answers-http"])
def test_a_foreign_server_on_master_port_fails_the_rendezvous_in_time_naming_the_address(tmp_path, answer):
    server = ForeignServer(answer)
    timeout = 6
    try:
        begun = time.monotonic()
        result = dptrain("train", "--dataset", "digits", "--epochs", "1", "--timeout", str(timeout),
                         "--out", str(tmp_path / "run"), cwd=tmp_path, timeout=timeout + 60,
                         env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(server.port), "DPTRAIN_DEBUG": "0"})
        took = time.monotonic() - begun
    finally:
        server.close()
    lines = result.stderr.splitlines()
    assert result.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("dptrain: error: "), result.stderr
    assert f"127.0.0.1:{server.port}" in lines[0] and "not a torch.distributed store" in lines[0], result.stderr
    assert took < timeout + 20, f"took {took:.1f} s"
