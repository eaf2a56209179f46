"""--stage-to DIR: shards copied to node-local disk in the background while training reads them.

A shared parallel file system is slow for many readers; node-local disk ($TMPDIR, /local/scratch) is fast.
Training does not wait for the copy. The first process of each node (LOCAL_RANK 0, or any process where no
launcher says) copies the shards in a background thread as its first epoch begins, in the order the node's
ranks will read them (`ShardedStream.copy_order`: this epoch's plan first, then the next epoch's, then the
rest). Every reader, in every rank and loader worker, opens a shard from DIR when its copy is complete there
(a file of its name, size and modification time) and from its original path otherwise: the same bytes either
way, so which samples come in which order, and a resume, do not depend on how far the copy got. A copy is
written to a temporary name and renamed, so a copy cut short is never taken for a shard; DIR's lock keeps two
processes that stage into one folder (two jobs of a node, a launcher that sets no LOCAL_RANK) from copying the
same shard. A resumed or requeued run finds the copies and copies nothing, and counts and reads the shards
there.

When the copy ends, one line says what it did (shards and bytes copied, shards already there, seconds), and
the run's summary.json keeps the same figures of every node under data.staging.nodes (`every_node`: gathered
from the first process of each node as the run ends), with their totals beside them. A copy that fails (DIR
not writable, a full disk) is one warning line; training goes on reading the shards from where they are. A run
that ends before the copy does stops it (its partial file removed) and says how far it got.

DPTRAIN_STAGE_SECONDS=S makes each shard's copy take S seconds longer: a slow file system rehearsed (tests).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Optional

from dptrain.errors import UserError

LOCK = ".dptrain-stage.lock"
SLOW = "DPTRAIN_STAGE_SECONDS"
CHUNK = 1 << 20
FIGURES = ("copied", "bytes", "already_there", "seconds", "finished")  # what a node's copy did, in summary.json


class _Stopped(Exception):
    """The run ended during a copy."""


def _plural(count: int) -> str:
    return f"{count} shard{'s' if count != 1 else ''}"


class Staging:
    """Where each of `paths` is read from (`where`), and their copy into `folder` in the background (`start`).
    `record`: what this process's copy did so far (its node's figures in summary.json's data.staging)."""

    def __init__(self, paths: list[str], folder: str, timeout: float = 300.0) -> None:
        names = [os.path.basename(path) for path in paths]
        if len(set(names)) != len(names):
            raise UserError(f"--stage-to {folder}: the shards' file names are not unique, so they cannot share one "
                            "folder; give shards with distinct names")
        self.paths, self.folder, self.timeout = list(paths), folder, timeout
        self.staged = {path: str(Path(folder) / name) for path, name in zip(paths, names)}
        self.sources = {path: _size_and_time(os.stat(path)) for path in paths}
        self.complete: set[str] = set()  # shards this process has seen complete in DIR
        self.record = {"folder": folder, "copied": 0, "bytes": 0, "already_there": 0, "seconds": 0.0,
                       "finished": False, "copier": _first_of_node(),
                       "host": socket.gethostname(), "path": os.path.abspath(folder)}
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def __getstate__(self) -> dict:  # a loader worker started by spawn maps paths; it never copies
        state = dict(self.__dict__)
        state.update(_thread=None, _stop=None)
        return state

    def where(self, path: str) -> str:
        """The staged copy of `path` when it is complete in DIR, else `path`."""
        if path in self.complete:
            return self.staged[path]
        if _size_and_time_of(self.staged.get(path)) == self.sources.get(path):
            self.complete.add(path)
            return self.staged[path]
        return path

    def start(self, order: list[int]) -> None:
        """Copy the shards not yet in DIR, `order` (indices of `paths`) first, in a background thread; once, and
        only in the first process of a node (LOCAL_RANK 0)."""
        if self._thread is not None or self._stop is None or not _first_of_node():
            return
        rest = [index for index in range(len(self.paths)) if index not in set(order)]
        self._thread = threading.Thread(target=self._copy, args=([*order, *rest],), name="dptrain-stage",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Whether the copy has ended (waiting at most `timeout` seconds for it)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def stop(self) -> None:
        """The run ends: a copy still running stops (its partial file removed) and says how far it got."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._stop.set()
        self._thread.join(30.0)

    def _copy(self, order: list[int]) -> None:
        began, target = time.perf_counter(), Path(self.folder)
        try:
            target.mkdir(parents=True, exist_ok=True)
            lock = _locked(target, self.timeout, self._stop)
        except (OSError, UserError) as error:
            _warn(f"--stage-to {self.folder} cannot be used: {getattr(error, 'strerror', None) or error}; the shards "
                  "are read from where they are")
            return
        if lock is None:  # the run ended while another process held the lock
            return
        try:
            self._copy_missing(order, began)
        finally:
            lock.close()

    def _copy_missing(self, order: list[int], began: float) -> None:
        delay = float(os.environ.get(SLOW, "0") or 0)
        for index in order:
            path = self.paths[index]
            if self.where(path) != path:
                self.record["already_there"] += 1
                continue
            partial = Path(self.folder) / f".{os.path.basename(path)}.partial-{os.getpid()}"
            try:
                if self._stop.wait(delay) if delay else self._stop.is_set():
                    raise _Stopped
                _copy_file(path, partial, self._stop)
                os.replace(partial, self.staged[path])
            except _Stopped:
                partial.unlink(missing_ok=True)
                self._say(began, ended=False)
                return
            except OSError as error:
                partial.unlink(missing_ok=True)
                _warn(f"--stage-to {self.folder}: copying '{path}' failed: {error.strerror or error}; the shards not "
                      "copied yet are read from where they are")
                return
            self.record.update(copied=self.record["copied"] + 1,
                               bytes=self.record["bytes"] + self.sources[path][0],
                               seconds=round(time.perf_counter() - began, 3))
        self.record.update(finished=True, seconds=round(time.perf_counter() - began, 3))
        self._say(began, ended=True)

    def _say(self, began: float, ended: bool) -> None:
        """The copy's line: what it copied (and found there), or, cut short by the run's end, how far it got."""
        record, seconds = self.record, time.perf_counter() - began
        if ended:
            print(f"dptrain: --stage-to {self.folder}: copied {_plural(record['copied'])} ({record['bytes']:,} "
                  f"bytes) in {seconds:.1f} s; {record['already_there']} already there", flush=True)
            return
        print(f"dptrain: --stage-to {self.folder}: the run ended with {record['copied']} of the "
              f"{_plural(len(self.paths) - record['already_there'])} to copy copied ({record['bytes']:,} bytes) in "
              f"{seconds:.1f} s; the next run copies the rest", flush=True)


def every_node(group, record: dict) -> dict[str, Any]:
    """summary.json's data.staging: each node's copy ("nodes": its host, the folder's absolute path and FIGURES),
    gathered over `group` from the processes that copy (the first of each node; several where no launcher says
    which is first, whose figures are one node's: summed, the fewest found there, the longest time), and their
    totals (`record`: this process's Staging.record). One node's totals are its own figures."""
    mine = {"host": record["host"], "folder": record["path"], **{key: record[key] for key in FIGURES}}
    nodes: dict[tuple[str, str], dict] = {}
    for figures in group.gather_objects("each node's staging", mine if record["copier"] else None):
        if not _figures(figures):  # (None: a process that does not copy)
            continue
        node = nodes.setdefault((figures["host"], figures["folder"]), {**figures, "copied": 0, "bytes": 0})
        node.update(copied=node["copied"] + figures["copied"], bytes=node["bytes"] + figures["bytes"],
                    already_there=min(node["already_there"], figures["already_there"]),
                    seconds=max(node["seconds"], figures["seconds"]),
                    finished=node["finished"] or figures["finished"])
    listed = list(nodes.values())
    return {"folder": record["folder"], "copied": sum(node["copied"] for node in listed),
            "bytes": sum(node["bytes"] for node in listed),
            "already_there": sum(node["already_there"] for node in listed),
            "seconds": max((node["seconds"] for node in listed), default=0.0),
            "finished": bool(listed) and all(node["finished"] for node in listed), "nodes": listed}


def _figures(value: Any) -> bool:
    """Whether a value gathered from a peer is a node's figures as every_node sends them."""
    kinds = {"host": str, "folder": str, "copied": int, "bytes": int, "already_there": int, "seconds": (int, float),
             "finished": bool}
    return isinstance(value, dict) and value.keys() == kinds.keys() and all(
        isinstance(value[key], kind) for key, kind in kinds.items())


def _first_of_node() -> bool:
    """Whether this process copies for its node: LOCAL_RANK 0, or any process where no launcher says."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _size_and_time(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_size, stat.st_mtime_ns


def _size_and_time_of(path: Optional[str]) -> Optional[tuple[int, int]]:
    try:
        return _size_and_time(os.stat(path)) if path is not None else None
    except OSError:
        return None


def _copy_file(source: str, partial: Path, stop: threading.Event) -> None:
    """`source` copied to `partial` a chunk at a time (stopping between chunks when `stop` is set), with its
    modification time (what tells a complete copy)."""
    import shutil

    with open(source, "rb") as reading, open(partial, "wb") as writing:
        while chunk := reading.read(CHUNK):
            if stop.is_set():
                raise _Stopped
            writing.write(chunk)
    shutil.copystat(source, partial)


def _warn(text: str) -> None:
    print(f"dptrain: warning: {text}", flush=True)


def _locked(folder: Path, timeout: float, stop: threading.Event):
    """DIR's lock, waited for at most `timeout` seconds (naming the process that holds it); None when `stop` is
    set meanwhile."""
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
                raise UserError(f"process {holder} has been copying shards there for more than {timeout:.0f} s"
                                ) from None
            if stop.wait(0.1):
                handle.close()
                return None
