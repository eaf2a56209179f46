"""Small findings of the third reliability pass (issue 32, item 6), each pinned by the behaviour a user sees."""

from __future__ import annotations

import errno
import os

import pytest

from dptrain.io import DiskError, disk_error, make_dirs


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.EPERM])
def test_a_directory_that_refuses_writes_is_named_as_not_writable_not_as_full(code):
    exc = OSError(code, os.strerror(code), "/data/runs/r1/config.yaml.tmp")

    error = disk_error(exc, "cannot write '/data/runs/r1/config.yaml'")

    assert isinstance(error, DiskError)
    message = str(error)
    assert "the directory '/data/runs/r1' is not writable" in message
    assert "give --out a writable directory" in message
    assert "free space" not in message


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_or_quota_asks_for_space(code):
    error = disk_error(OSError(code, os.strerror(code), "run/x.tmp"), "cannot write 'run/x'")

    assert "free space" in str(error) and "not writable" not in str(error)


def test_another_os_error_stays_itself():
    exc = OSError(errno.EIO, "I/O error", "run/x")

    assert disk_error(exc, "cannot write 'run/x'") is exc


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
def test_a_real_read_only_mount_names_the_directory_as_not_writable(tmp_path):
    import subprocess

    target = tmp_path / "readonly"
    target.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with pytest.raises(DiskError) as raised:
            make_dirs(target / "run")
    finally:
        subprocess.run(["umount", str(target)], check=True)

    message = str(raised.value)
    assert f"cannot create directory '{target / 'run'}': read-only file system" in message
    assert f"the directory '{target}' is not writable; give --out a writable directory" in message
    assert "free space" not in message


# --slow-worker: a delay measured on the rank's own compute, not on steps that include its waits for the others.

def test_the_delay_of_a_slowed_rank_is_a_fixed_multiple_of_its_own_compute():
    from dptrain.train.straggler import StepDelay

    delay = StepDelay(factor=3.0, compute_per_sample=0.002)

    assert delay.per_sample == pytest.approx(0.004)
    assert delay.seconds(32) == pytest.approx(0.128) and delay.seconds(5) == pytest.approx(0.02)  # a short last batch


def test_two_slowed_ranks_under_allreduce_finish_without_a_change_of_members_and_sleep_by_their_compute(tmp_path):
    import json
    import re

    from test_train_cli import dptrain

    result = dptrain("train", "--dataset", "digits", "--strategy", "allreduce", "--workers", "3", "--min-workers", "2",
                     "--epochs", "1", "--slow-worker", "1:3,2:4", "--no-progress", "--out", "run", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [record["epoch"] for record in records] == [1]
    assert not any(record.get("membership") for record in records), records  # no worker given up as frozen
    said = re.findall(r"\[rank(\d)\] dptrain: rank (\d): --slow-worker (\S+): its own compute is (\S+) ms per sample "
                      r"\(measured without communication\); each step sleeps (\S+) ms per sample more", result.stderr)
    assert sorted((prefix, rank, factor) for prefix, rank, factor, _, _ in said) == [("1", "1", "3"), ("2", "2", "4")]
    for _, _, factor, compute, sleep in said:
        assert float(compute) > 0
        assert float(sleep) == pytest.approx((float(factor) - 1) * float(compute), rel=1e-4)


@pytest.mark.slow
def test_a_frozen_worker_does_not_keep_the_launcher_after_a_stop_signal_past_the_timeout(tmp_path):
    """The adversarial benchmark's streaming freeze: with --min-workers the others went on without a frozen
    worker; SIGTERM then stopped them at a checkpoint, and the launcher waited for the frozen one forever
    (no --grace meant no limit). The default grace is --timeout: the frozen worker is named and killed."""
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "fired"
    env = {**os.environ, "DPTRAIN_FAULT": "train-middle@1:2", "DPTRAIN_FAULT_ACTION": "freeze",
           "DPTRAIN_FAULT_ONCE": str(marker)}
    launcher = subprocess.Popen([sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--model", "mlp",
                                 "--strategy", "sync", "--workers", "2", "--min-workers", "1", "--epochs", "500",
                                 "--timeout", "6", "--no-progress", "--out", str(tmp_path / "run")],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(240):
            if marker.exists() or launcher.poll() is not None:
                break
            time.sleep(0.5)
        assert marker.exists(), "rank 1 never froze"
        time.sleep(2)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "dptrain: worker rank 1 had not exited 6 s (--grace) after SIGTERM; killing it" in err, err
    assert launcher.returncode == 75, err  # the others stopped at a checkpoint: the same command continues
