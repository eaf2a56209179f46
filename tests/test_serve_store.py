"""`dptrain serve-store`, the job's store in a process of its own (SLURM job scripts with --min-workers):
it says where it serves in RUN_DIR/join.address while the run is there, and with --replace N it runs
--replace-command once for each rank the others left out (recorded in the store), N times at most."""

from __future__ import annotations

import datetime
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from dptrain.errors import UserError
from dptrain.runtime.membership import LOST, REPLACING, WORLD
from dptrain.runtime.spawn import job_store
from test_train_cli import dptrain


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(check, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "waited too long"
        time.sleep(0.1)


def test_it_says_where_it_serves_and_starts_a_new_worker_for_each_rank_left_out_up_to_n(tmp_path):
    run, started = tmp_path / "run", tmp_path / "started"
    run.mkdir()
    started.mkdir()
    port = free_port()
    # the "new worker": a command that leaves a file behind, one per start
    command = f"{sys.executable} -c \"import os, sys; open(os.path.join(sys.argv[1], str(os.getpid())), 'w')\" {started}"
    service = subprocess.Popen([sys.executable, "-m", "dptrain", "serve-store", "--host", "127.0.0.1", "--port",
                                str(port), "--world", "3", "--run-dir", str(run), "--replace", "2",
                                "--replace-command", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        store = job_store(dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30)))
        assert store.get(WORLD) == b"3" and store.get(REPLACING) == b"2"
        time.sleep(1)
        assert not (run / "join.address").exists()  # not before the run has started (its config.yaml)
        (run / "config.yaml").write_text("strategy: sync\n")
        wait_for(lambda: (run / "join.address").exists())
        assert (run / "join.address").read_text() == f"127.0.0.1:{port}\n"
        # what the agreements' decider records for each rank left out: ranks 1, then 0 and 2
        for rank in (1, 0, 2):
            index = store.add(LOST, 1)
            store.set(f"{LOST}/{index}", str(rank))
        wait_for(lambda: len(list(started.iterdir())) == 2)
        time.sleep(2)
        assert len(list(started.iterdir())) == 2  # --replace 2: the third one is not replaced
        service.send_signal(signal.SIGTERM)
        out, err = service.communicate(timeout=30)
    finally:
        service.kill()
    assert service.returncode == 0, err
    assert out.splitlines() == [
        f"dptrain: serving the job's store at 127.0.0.1:{port} for 3 ranks",
        f"dptrain: starting a new worker in place of rank 1 (1 more may be replaced): {command}",
        f"dptrain: starting a new worker in place of rank 0 (0 more may be replaced): {command}"]
    assert not (run / "join.address").exists()  # removed when it stops


def test_a_new_worker_that_cannot_start_is_said_once_and_the_store_goes_on_serving(tmp_path):
    port = free_port()
    service = subprocess.Popen([sys.executable, "-m", "dptrain", "serve-store", "--host", "127.0.0.1", "--port",
                                str(port), "--world", "2", "--replace", "2", "--replace-command",
                                str(tmp_path / "no-such-program")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        store = job_store(dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30)))
        store.set(f"{LOST}/{store.add(LOST, 1)}", "1")
        time.sleep(2)
        store.set("still", "serving")
        assert store.get("still") == b"serving"
        service.send_signal(signal.SIGTERM)
        out, err = service.communicate(timeout=30)
    finally:
        service.kill()
    assert service.returncode == 0, err
    assert out.splitlines()[2:] == [f"dptrain: no more new workers in place of lost ranks: FileNotFoundError: [Errno 2] "
                                    f"No such file or directory: '{tmp_path / 'no-such-program'}'"]


@pytest.mark.parametrize("args, message", [
    (["--world", "0"], "--world 0 must be at least 1 (the job's ranks)"),
    (["--port", "0"], "--port 0 must be between 1 and 65535"),
    (["--replace", "-1"], "--replace -1 must be 0 or more (the new workers to start at most)"),
    (["--replace", "2"], "--replace 2 needs --replace-command, the command line that starts a new worker"),
    (["--replace", "1", "--replace-command", " "],
     "--replace-command ' ' is empty; give the command line that starts a new worker"),
])
def test_bad_values_are_one_line_naming_them(tmp_path, args, message):
    base = {"--host": "127.0.0.1", "--port": "29999", "--world": "2"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    result = dptrain("serve-store", *[word for pair in base.items() for word in pair], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == f"dptrain: error: {message}"


def test_replace_workers_under_srun_needs_a_store_service_that_replaces():
    from dptrain.train.command import _check_replacing

    port = free_port()
    store = job_store(dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=30)))
    ctx = SimpleNamespace(group=SimpleNamespace(store=store))
    with pytest.raises(UserError, match=r"--replace-workers under srun needs the job's store served by `dptrain "
                                        r"serve-store --replace N`"):
        _check_replacing(ctx, "srun")
    store.set(REPLACING, "2")
    _check_replacing(ctx, "srun")
