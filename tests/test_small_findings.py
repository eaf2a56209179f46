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
