"""--stage-to DIR: shards copied to node-local disk once, before training, and read from there.

A shared parallel file system is slow for many readers; node-local disk ($TMPDIR, /local/scratch) is fast.
Every process of a node that loads the data calls `stage`; the first to take DIR's lock copies what is
missing (the launching process, under dptrain's own launcher, before any rank starts), the others find
every shard there already. A shard is reused when a file of its name, size and modification time is in DIR
(a resumed or requeued run copies nothing); one is copied to a temporary name and renamed, so a copy cut
short is never taken for a shard. The copy runs before training, not in the background.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dptrain.errors import UserError

LOCK = ".dptrain-stage.lock"


@dataclass(frozen=True)
class Staged:
    """Where each shard is now, and what staging did: shards and bytes copied, shards reused, seconds."""

    paths: list[str]
    copied: int
    copied_bytes: int
    reused: int
    seconds: float

    def line(self, folder: str) -> str:
        return (f"dptrain: --stage-to {folder}: copied {self.copied} shard{'s' if self.copied != 1 else ''} "
                f"({self.copied_bytes:,} bytes) in {self.seconds:.1f} s; {self.reused} already there")


def _same(source: os.stat_result, staged: Path) -> bool:
    try:
        there = staged.stat()
    except FileNotFoundError:
        return False
    return there.st_size == source.st_size and there.st_mtime_ns == source.st_mtime_ns


def _locked(folder: Path, timeout: float):
    """DIR's lock, waited for at most `timeout` seconds (naming the process that holds it)."""
    handle = open(folder / LOCK, "a+")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            return handle
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                raise UserError(f"--stage-to {folder}: process {holder} has been copying shards there for more "
                                f"than {timeout:.0f} s; wait for it, or give another --stage-to") from None
            time.sleep(0.1)


def stage(paths: list[str], folder: str, timeout: float = 300.0) -> Staged:
    """`paths` copied into `folder` (made if missing) where not there already; their staged paths, in order."""
    target = Path(folder)
    names = [os.path.basename(path) for path in paths]
    if len(set(names)) != len(names):
        raise UserError(f"--stage-to {folder}: the shards' file names are not unique, so they cannot share one "
                        "folder; give shards with distinct names")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"--stage-to {folder} cannot be made: {error.strerror}; give a writable folder") from None
    began = time.perf_counter()
    copied = copied_bytes = 0
    lock = _locked(target, timeout)
    try:
        for path, name in zip(paths, names):
            source, staged = os.stat(path), target / name
            if _same(source, staged):
                continue
            partial = target / f".{name}.partial-{os.getpid()}"
            try:
                shutil.copy2(path, partial)
            except OSError as error:
                partial.unlink(missing_ok=True)
                raise UserError(f"--stage-to {folder}: copying '{path}' failed: {error.strerror}; free space there "
                                "or give another folder") from None
            os.replace(partial, staged)
            copied, copied_bytes = copied + 1, copied_bytes + source.st_size
    finally:
        lock.close()
    return Staged([str(target / name) for name in names], copied, copied_bytes, len(paths) - copied,
                  time.perf_counter() - began)
