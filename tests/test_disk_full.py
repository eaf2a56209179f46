"""A disk that is full or refuses writes gives one line and exit 2, loses nothing, and the same command works later.

Each test mounts its own tiny tmpfs (or a read-only bind mount) under tmp_path and unmounts it
afterwards, so it needs root; the runs are real `dptrain train` commands with 2 workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dptrain.train import checkpoint_files
from test_train_cli import dptrain

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")]

# hidden=[1024]: each rank file is about 620 kB (weights and momentum), so a 2 MB disk holds the
# first epoch's checkpoint (both ranks) but not the second's.
BIG_MODEL = ["--model", "mlp", "--model-option", "hidden=[1024]"]


def train_argv(out: Path, epochs: int = 3, *extra: str) -> list[str]:
    return ["train", "--dataset", "digits", "--workers", "2", "--epochs", str(epochs), "--out", str(out), *extra]


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def mounts():
    """mount(target, *options) for the test; every mount is undone afterwards, newest first."""
    made: list[Path] = []

    def make(target: Path, *args: str) -> Path:
        target.mkdir(exist_ok=True)
        mount(*args, str(target))
        made.append(target)
        return target

    yield make
    for target in reversed(made):
        subprocess.run(["umount", str(target)], check=False, capture_output=True)
        if os.path.ismount(target):  # a stray process still holds it: detach it lazily
            subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)


def fill(directory: Path) -> Path:
    """Write a file until the disk is full; return it (delete it to free the space)."""
    filler = directory / "filler"
    with open(filler, "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError:
            pass
    return filler


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower() or "Errno" in line]


def assert_one_clean_line(result: subprocess.CompletedProcess, *names: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    errors = error_lines(result.stderr)
    assert errors and all("dptrain: error: " in line for line in errors), result.stderr
    for name in names:
        assert name in errors[0], result.stderr


def leftovers(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*.tmp")]


def test_a_full_disk_before_training_writes_no_half_config_and_the_same_command_works_later(tmp_path, mounts):
    disk = mounts(tmp_path / "disk", "-t", "tmpfs", "-o", "size=1m", "tmpfs")
    filler = fill(disk)
    out = disk / "run"

    result = dptrain(*train_argv(out, 1), cwd=tmp_path)

    assert_one_clean_line(result, str(out), "no space left on device")  # the lock file is the first it writes
    assert len(error_lines(result.stderr)) == 1
    assert not (out / "config.yaml").exists() and not leftovers(disk)
    filler.unlink()
    again = dptrain(*train_argv(out, 1), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (out / "summary.json").exists()


def test_a_disk_that_fills_during_training_keeps_the_last_checkpoint_and_resumes(tmp_path, mounts):
    disk = mounts(tmp_path / "disk", "-t", "tmpfs", "-o", "size=2m", "tmpfs")
    out = disk / "run"

    result = dptrain(*train_argv(out, 3, *BIG_MODEL), cwd=tmp_path)

    assert_one_clean_line(result, "epoch-000002", "no space left on device")
    assert not leftovers(disk)
    assert checkpoint_files.latest_complete(out, 2)[0] == 1
    for rank in (0, 1):
        assert checkpoint_files.load(out, 1, rank)["epoch"] == 1
    mount("-o", "remount,size=16m", str(disk))  # space freed
    again = dptrain(*train_argv(out, 3, *BIG_MODEL), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "resuming after epoch 1" in again.stdout + again.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [record["epoch"] for record in records] == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["epochs"] == 3


@pytest.mark.parametrize("subdirectory", ["", "run"], ids=["out-is-the-mount", "out-below-the-mount"])
def test_a_read_only_out_directory_gives_one_line(tmp_path, mounts, subdirectory):
    source = tmp_path / "source"
    source.mkdir()
    target = mounts(tmp_path / "readonly", "--bind", str(source))
    mount("-o", "remount,bind,ro", str(target))
    out = target / subdirectory if subdirectory else target

    result = dptrain(*train_argv(out, 1), cwd=tmp_path)

    assert_one_clean_line(result, str(out), "read-only file system", f"'{target}' is not writable",
                          "give --out a writable directory")
    assert "free space" not in result.stderr
    assert len(error_lines(result.stderr)) == 1
    assert list(source.iterdir()) == []


def test_under_torchrun_a_full_disk_is_one_line_not_one_per_rank(tmp_path, mounts):
    # The rank that cannot write says why; its peer, whose collective then fails, ends with the same code and
    # no line of its own (under dptrain's launcher, srun or mpirun too: each rank writes to the same terminal).
    disk = mounts(tmp_path / "disk", "-t", "tmpfs", "-o", "size=2m", "tmpfs")
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [arg for arg in train_argv(disk / "run", 3, *BIG_MODEL) if arg not in ("--workers", "2")]  # torchrun's 2
    result = subprocess.run([str(torchrun), "--nproc-per-node", "2", "-m", "dptrain", *argv], cwd=tmp_path,
                            capture_output=True, text=True, timeout=240)
    ours = [line for line in result.stderr.splitlines() if line.startswith("dptrain: ")]
    assert len(ours) == 1 and "no space left on device" in ours[0], result.stderr
    assert "exitcode: 2" in result.stderr and "stopped responding" not in result.stderr, result.stderr
