"""The run directory: resolved config, metrics.jsonl, summary.json, model.pt. Never overwrites a run.

One run at a time per directory: `lock_run_dir` holds an exclusive lock for the whole run.
"""

from __future__ import annotations

import errno
import json
import fcntl
import os
import secrets
import socket
import time
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Optional

from dptrain.config import RUN_SETTINGS, TrainConfig, read_yaml, with_absolute_paths
from dptrain.errors import UserError
from dptrain.user_code import spec_file
from dptrain.io import disk_error, make_dirs, open_private, timestamped, write_text

RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "model.pt")
# Marks a directory dptrain claimed for a run (`dptrain launch` claims it before the job writes its
# script and output there): only such a directory, a new one or an empty one takes a run.
MARKER = ".dptrain-run"
RUN_ID = "run id: "  # the marker's line naming the run: a random id made when the run directory is first claimed


def default_run_dir(strategy: str, job_id: Optional[str] = None) -> str:
    """runs/STRATEGY-JOBID under a scheduler (so a restarted job finds its run), else a timestamp."""
    return timestamped("runs", strategy, job_id if job_id and job_id != "none" else None)


# Settings that may change between an interrupted run and its continuation.
RESUMABLE_CHANGES = {"out", "resume", "progress", "timeout", "epochs", "max_restarts", "grace", "checkpoint_every",
                     "checkpoint_every_steps", "keep_checkpoints", "replace_workers", "max_workers",
                     "commit_every_steps", "resume_with_changed_data", "nnodes", "node_rank", "master",
                     "tensorboard", "log_to", "monitor", "early_stop_patience",
                     # another shard size reshards the checkpoint (dptrain.train.reshard); the unit, precision,
                     # offload and activation recomputation leave each rank's shards (fp32, rows of each parameter)
                     # as they are
                     "shard", "shard_size", "shard_unit", "shard_precision", "shard_offload", "shard_checkpoint"}
# A setting that may change where the strategy can take it (other_world_refused says why one cannot).
WORKERS = "workers"


def claim_run_dir(path: str, out: str = "--out") -> Path:
    """Create `path` for a new run (or take an empty one, or one dptrain claimed before, or one whose run
    recorded nothing), refusing one that holds a run's files or files of anything else; marks it as a run
    directory."""
    directory = Path(path)
    _check_claim(path, out)
    _make_run_dir(path, out)
    if not (directory / MARKER).exists():
        write_text(directory / MARKER, f"a dptrain run directory\n{RUN_ID}{secrets.token_hex(8)}\n")
    return directory


def run_id(directory: Path, create: bool = True) -> Optional[str]:
    """The id of the run in `directory` (its marker's `run id:` line). Each checkpoint records it, so that one
    copied in from another run is told apart (dptrain.train.checkpoint_files). A run directory claimed before
    runs had ids, or made by the Python API without a claim, gets one now (`create`; else None)."""
    marker = Path(directory) / MARKER
    text = marker.read_text() if marker.is_file() else "a dptrain run directory\n"
    for line in text.splitlines():
        if line.startswith(RUN_ID) and line[len(RUN_ID):].strip():
            return line[len(RUN_ID):].strip()
    if not create:
        return None
    made = secrets.token_hex(8)
    make_dirs(Path(directory))
    write_text(marker, f"{text.rstrip()}\n{RUN_ID}{made}\n")
    return made


def _check_claim(path: str, out: str = "--out") -> None:
    """claim_run_dir's refusals, writing nothing (`out`: how the user named the directory, --out or out=)."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"run directory '{path}' is a file; give {out} a new directory")
    held = [name for name in RUN_FILES if directory.is_dir() and (directory / name).exists()]
    if held and not recorded_nothing(directory):
        raise UserError(f"run directory '{path}' already holds a run ({', '.join(held)}); give {out} a new directory")
    if directory.is_dir() and not (directory / MARKER).exists():
        _refuse_other_files(path, out)


def recorded_nothing(directory: Path) -> bool:
    """Whether `directory` holds a run that dptrain started but that recorded nothing (its config.yaml alone:
    it failed before its first epoch and checkpoint). Nothing there is worth keeping, so a new run, with other
    settings too (the data fixed), takes the directory over."""
    return ((directory / MARKER).exists() and (directory / "config.yaml").exists()
            and not any((directory / name).exists() for name in RUN_FILES if name != "config.yaml")
            and not (directory / "checkpoints").exists())


def _refuse_other_files(path: str, out: str = "--out") -> None:
    """A directory holding files that are not a run's (`--out .` in a project folder) is not taken."""
    others = sorted(entry.name for entry in Path(path).iterdir() if entry.name not in (LOCK_FILE, MARKER))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise UserError(f"{out} '{path}' holds files that are not a dptrain run ({shown}); give {out} a new or "
                        "empty directory")


def _is_run_dir(directory: Path) -> bool:
    """Whether dptrain made this directory a run's (a marker, or, for runs older than the marker, a config.yaml
    with the metrics or checkpoints of that run beside it): a hand-written config.yaml is not a run."""
    return (directory / MARKER).exists() or (directory / "config.yaml").exists() and (
        (directory / "metrics.jsonl").exists() or (directory / "checkpoints").is_dir())


def _make_run_dir(path: str, out: str = "--out") -> bool:
    """Create the run directory if needed; whether it was created now."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"run directory '{path}' is a file; give {out} a new directory")
    if directory.is_dir():
        return False
    try:
        make_dirs(directory)
    except OSError as exc:
        raise UserError(f"cannot create run directory '{path}': {exc.strerror}") from None
    return True


LOCK_FILE = "dptrain.lock"
_HELD: set[Path] = set()  # the run directories this process holds now (lock_run_dir), resolved
# Where the launcher of a run that takes joiners (--min-workers) serves its store, while it runs: `dptrain join`.
JOIN_FILE = "join.address"


@contextmanager
def lock_run_dir(path: str, out: str = "--out") -> Iterator[Path]:
    """Hold the run directory `path` (created if needed) exclusively while the block runs.

    Two runs writing one directory would interleave their metrics and checkpoints. The lock
    is an flock on PATH/dptrain.lock: the kernel frees it when its holder dies, however it
    dies, so a crashed run never blocks the next one. The file also names the holder (PID and
    host) for the refusal message, and a name left there by a run that died is reported when
    the lock is taken over. The lock file is removed on release, and a directory this call
    created is removed again if the run left nothing in it (a refused run changes nothing).
    """
    created = _make_run_dir(path, out)
    lock = Path(path) / LOCK_FILE
    try:
        handle = _acquire(lock, path, out)
    except BaseException:
        _remove_if_empty(path, created)
        raise
    _HELD.add(Path(path).resolve())
    try:
        yield Path(path)
    finally:
        _HELD.discard(Path(path).resolve())
        # Unlink while still holding the lock: a process that opened the old file meanwhile
        # sees that it was replaced (see _acquire) instead of locking a file nobody else will.
        try:
            lock.unlink()
        except OSError:
            pass
        handle.close()
        _remove_if_empty(path, created)


def check_not_busy(path: str) -> None:
    """Refuse `path` when another run holds it (as lock_run_dir would), without creating or changing anything:
    a cheap check before the data is read. The lock itself is taken later, and may still be refused then."""
    lock = Path(path) / LOCK_FILE
    try:
        handle = open(lock, "rb")
    except OSError:
        return  # no lock file: nobody holds the directory (or it is not there yet)
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"run directory '{path}' is in use by another dptrain run "
                            f"({_holder_when_written(handle) or 'PID not yet written'}); wait for it to end or give "
                            "--out another directory") from None
        except OSError:
            return  # no flock on this file system: lock_run_dir decides
        fcntl.flock(handle, fcntl.LOCK_UN)


def _acquire(lock: Path, path: str, out: str = "--out"):
    while True:
        try:
            handle = open_private(lock, os.O_RDWR | os.O_APPEND, "a+b", buffering=0)  # unbuffered: a full disk fails the write, not close()
        except OSError as exc:
            raise disk_error(exc, f"cannot create the lock file '{lock}'") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            supported = True
        except BlockingIOError:
            holder = _holder_when_written(handle)
            handle.close()
            raise UserError(f"run directory '{path}' is in use by another dptrain run ({holder or 'PID not yet written'}); wait for it "
                            f"to end or give {out} another directory") from None
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
                raise
            supported = False  # e.g. Lustre mounted without flock: fall back to the PID written inside
        try:
            replaced = os.fstat(handle.fileno()).st_ino != os.stat(lock).st_ino
        except FileNotFoundError:
            replaced = True
        if replaced:  # its holder removed it between our open and our flock: lock the new one
            handle.close()
            continue
        break
    previous = _holder(handle)
    if previous and not supported and _alive_elsewhere(handle):
        handle.close()
        raise UserError(f"run directory '{path}' is in use by another dptrain run ({previous}); wait for it "
                        f"to end or give {out} another directory (or remove '{lock}' if that run is gone)")
    if previous:
        print(f"dptrain: taking over run directory '{path}' from a run that ended without releasing it "
              f"({previous})", file=sys.stderr, flush=True)
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()} {socket.gethostname()}\n".encode())
        os.fsync(handle.fileno())
    except OSError as exc:
        handle.close()
        lock.unlink(missing_ok=True)
        raise disk_error(exc, f"cannot write the lock file '{lock}'") from None
    return handle


def _holder_fields(handle) -> Optional[tuple[int, str]]:
    handle.seek(0)
    fields = handle.read().decode(errors="replace").split()
    if len(fields) == 2 and fields[0].isdigit():
        return int(fields[0]), fields[1]
    return None


def _holder_when_written(handle, wait: float = 5.0) -> str:
    """The holder's name; it writes it just after taking the lock, so wait a moment for it."""
    deadline = time.monotonic() + wait
    while True:
        holder = _holder(handle)
        if holder or time.monotonic() >= deadline:
            return holder
        time.sleep(0.02)


def _holder(handle) -> str:
    fields = _holder_fields(handle)
    return f"PID {fields[0]} on host {fields[1]}" if fields else ""


def _alive_elsewhere(handle) -> bool:
    """Without flock: whether the PID in the lock file may still run (on another host we cannot tell)."""
    pid, host = _holder_fields(handle)
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


def _remove_if_empty(path: str, created: bool) -> None:
    if created:
        try:
            Path(path).rmdir()
        except OSError:
            pass  # the run wrote something: keep it


def _moved(key: str, recorded: Any, now: Any) -> bool:
    """Whether --data or a model's file, recorded by an absolute path that is gone, is now named by another
    path with the same file name (the project moved): then it is taken to be the same, as the names
    are all that can be compared."""
    if key not in ("data", "model") or not isinstance(recorded, str) or not isinstance(now, str):
        return False
    recorded_path, _, recorded_attribute = recorded.rpartition(":") if spec_file(recorded) else (recorded, "", "")
    now_path, _, now_attribute = now.rpartition(":") if spec_file(now) else (now, "", "")
    return (os.path.isabs(recorded_path) and not os.path.exists(recorded_path) and recorded_attribute == now_attribute
            and os.path.basename(recorded_path.rstrip("/")) == os.path.basename(now_path.rstrip("/")))


# What a run recorded before a setting existed did, where that differs from the setting's default now:
# such a run continues only with that value given (e.g. --lr-scaling none), and the refusal says so.
BEFORE_IT_EXISTED = {"lr_scaling": "none"}
# Settings whose default became None ("decided by other settings") with --lr-scaling: in a run recorded
# before that, the old default means the same as not given.
OLD_DEFAULTS = {"warmup_epochs": 0.0}


def _default(key: str) -> Any:
    """What a run recorded before `key` existed did, as config.yaml records it (tuples as lists)."""
    if key in BEFORE_IT_EXISTED:
        return BEFORE_IT_EXISTED[key]
    field = TrainConfig.model_fields.get(key)
    return None if field is None else json.loads(json.dumps(field.default))


def _check_other_world(path: str, settings: dict[str, Any], recorded: int, workers: int) -> None:
    """A run continued on `workers` workers, `recorded` in its config.yaml: where its strategy resumes on another
    number (its rules' other_world_refused; whether a checkpoint within an epoch can is decided with the
    checkpoint, dptrain.train.checkpointer), or on as many as wrote its newest complete checkpoint."""
    from dptrain import registry
    from dptrain.strategies.rules import RESUME_ON_ANY_NUMBER
    from dptrain.train import checkpoint_files  # torch: only a run continued on another number of workers needs it

    strategy = settings.get("strategy", "allreduce")
    refused = registry.load("strategy rules", strategy).other_world_refused(SimpleNamespace(**settings))
    if refused is None:
        return
    at, _ = checkpoint_files.latest_complete(Path(path), recorded)
    written = checkpoint_files.manifest(Path(path), at, recorded)["world_size"] if at is not None else recorded
    if workers != written:
        raise UserError(f"run directory '{path}' holds a run of {strategy} on {written} workers, {workers} now: "
                        f"{strategy} cannot resume on another number of workers ({refused}); give --workers "
                        f"{written} to continue it ({RESUME_ON_ANY_NUMBER}), or --out a new directory")


def open_run_dir(path: str, settings: dict[str, Any], resume: bool = False) -> tuple[Path, bool]:
    """(run directory, whether it continues an interrupted run with the same settings).

    A new directory is created; a finished run (summary.json) is refused; an unfinished run
    with the same settings is continued from its checkpoints; different settings are refused,
    naming the first difference; a run that recorded nothing is started afresh (see
    `recorded_nothing`). Nothing on disk is overwritten before that decision; a finished run continued to more
    --epochs keeps its summary and model as they are until `keep_finished`, after its checkpoint was checked.
    """
    if check_run_dir(path, settings, resume):
        return Path(path), True
    return claim_run_dir(path), False


def keep_finished(path: Path, settings: dict[str, Any]) -> None:
    """Where `path` holds a finished run that `settings` continue to more --epochs (open_run_dir let it through),
    its summary.json and model.pt kept under the epoch they were of: called once every check of the checkpoint it
    continues from has passed, so that a refused continuation leaves the finished run as it was."""
    if (path / "summary.json").exists():
        _keep_finished(path, _extension(path, settings), settings["epochs"])


def _extension(directory: Path, settings: dict[str, Any]) -> Optional[int]:
    """The epochs of the finished run in `directory` where `settings` ask for more (--epochs raised), so that it
    is continued from the checkpoint of its last epoch; None where they do not. One line where that checkpoint is
    missing."""
    saved = directory / "config.yaml"
    if not (directory / "summary.json").exists() or not saved.exists():
        return None
    before = read_yaml(saved, "run settings file", f"{RUN_SETTINGS}, or give --out a new directory").get("epochs")
    asked = settings.get("epochs")
    if not isinstance(before, int) or not isinstance(asked, int) or asked <= before:
        return None
    from dptrain.train import checkpoint_files  # torch: only a run extended needs it

    workers = settings.get(WORKERS) if isinstance(settings.get(WORKERS), int) else 1
    newest, _ = checkpoint_files.latest_complete(directory, workers)
    if newest != before:
        have = f"the newest is of {'epoch ' + str(newest) if isinstance(newest, int) else newest}" if newest else "it has none"
        raise UserError(f"run directory '{directory}' holds a finished run of {before} epochs without a checkpoint "
                        f"of its last epoch ({have}), so --epochs {asked} cannot continue it; give --out a new "
                        "directory")
    return before


def _keep_finished(directory: Path, before: int, epochs: int) -> None:
    """A finished run of `before` epochs continued to `epochs`: its summary.json and model.pt kept as
    summary-epoch-E.json and model-epoch-E.pt (the run is unfinished again until its new end), said in one line."""
    kept = []
    for name, stem, suffix in (("summary.json", "summary", ".json"), ("model.pt", "model", ".pt")):
        if (directory / name).exists():
            target = directory / f"{stem}-epoch-{before}{suffix}"
            os.replace(directory / name, target)
            kept.append(target.name)
    print(f"dptrain: continuing the finished run in {directory} from epoch {before} to {epochs} (--epochs {epochs}); "
          f"its {' and '.join(kept)} are kept; the LR schedule now ends at epoch {epochs}", flush=True)


def check_run_dir(path: str, settings: dict[str, Any], resume: bool = False, only_runs: bool = False) -> bool:
    """open_run_dir's refusals, writing nothing (so that they can come before the data is read): whether `path`
    holds a run to continue (False: a new run will be started there). `only_runs`: refuse only what concerns a
    run found there (finished, other settings, nothing to resume), not a new directory or one of other files."""
    directory = Path(path)
    saved = directory / "config.yaml"
    if only_runs and not (directory.is_dir() and _is_run_dir(directory)):
        return False
    if directory.is_dir() and not _is_run_dir(directory):
        if resume:
            raise UserError(f"--resume: run directory '{path}' holds no run to continue")
        _refuse_other_files(path)
    if _extension(directory, settings) is None:  # (a finished run is continued only to more --epochs)
        _refuse_finished(path)
    if not saved.exists() or recorded_nothing(directory) and not resume:
        if resume:
            raise UserError(f"--resume: run directory '{path}' holds no run to continue")
        _check_claim(path)
        return False
    # A run recorded before config.yaml held absolute paths named its files relative to the same directory.
    previous = with_absolute_paths(read_yaml(saved, "run settings file", f"{RUN_SETTINGS}, or give --out a new directory"))
    for key, value in settings.items():
        recorded = previous[key] if key in previous else _default(key)  # a setting newer than the run
        if key in OLD_DEFAULTS and value is None and recorded == OLD_DEFAULTS[key] and "lr_scaling" not in previous:
            recorded = None
        if key == WORKERS and recorded != value:
            _check_other_world(path, settings, recorded, value)
        elif key not in RESUMABLE_CHANGES and recorded != value and not _moved(key, recorded, value):
            raise UserError(f"run directory '{path}' holds a run with other settings ({key}: {recorded!r} "
                            f"there, {value!r} now); give --out a new directory, or the same settings to continue it")
    if resume and not (directory / "checkpoints").is_dir():
        raise UserError(f"--resume: run directory '{path}' has no checkpoint yet")
    return True


def _refuse_finished(path: str, out: str = "--out") -> None:
    if (Path(path) / "summary.json").exists():
        raise UserError(f"run directory '{path}' holds a finished run (summary.json); give {out} a new directory")


API_OUT = "out="  # how the Python API's refusals name the run directory: Trainer(..., out=DIR)


def check_api_run_dir(path: str, resume: bool) -> bool:
    """check_run_dir's rules for a run of the Python API (Trainer(out=...).fit), which records no settings to
    compare: whether it continues the run in `path` (False: a new run starts there), writing nothing.

    A run of `dptrain train` (config.yaml: its settings are that command's to continue) is refused, and so is a
    finished run (summary.json), unless `resume=True` and it has checkpoints to train on from; an unfinished run of
    the API (its metrics, model or checkpoints) is continued with `resume=True` and refused without; where there
    is no run, `resume=True` starts one (the same script starts a run and continues it after a stop); a directory
    of other files is refused."""
    directory = Path(path)
    if not directory.is_dir():
        _check_claim(path, API_OUT)
        return False
    command_run = (directory / "config.yaml").exists() and _is_run_dir(directory) and not recorded_nothing(directory)
    if command_run or not (resume and (directory / "checkpoints").is_dir()):
        _refuse_finished(path, API_OUT)
    if command_run:
        raise UserError(f"run directory '{path}' holds a run of `dptrain train` (config.yaml); continue it with "
                        f"`dptrain train --config {directory / 'config.yaml'}`, or give {API_OUT} a new directory")
    recorded = [name for name in ("metrics.jsonl", "model.pt", "checkpoints") if (directory / name).exists()]
    if (directory / MARKER).exists() and recorded:
        if not resume:
            raise UserError(f"run directory '{path}' holds an unfinished run ({', '.join(recorded)}); pass "
                            f"resume=True to continue it, or give {API_OUT} a new directory")
        return True
    _check_claim(path, API_OUT)
    return False


def open_for_trainer(out: Optional[Path], resume: bool, ctx, held: ExitStack) -> None:
    """A Trainer's run directory, opened by the rules `dptrain train` keeps (check_api_run_dir): rank 0 locks it
    into `held` (kept for the whole fit) and claims it, and every rank raises rank 0's refusal. Nothing is done where
    the caller opened it: `dptrain train` (its launcher, for its own workers; or this very process, which holds its
    lock), or where the worker joins a running job."""
    if out is None or ctx.launcher == "local" or ctx.joining is not None:
        return
    refusal = None
    if ctx.is_main and Path(out).resolve() not in _HELD:
        try:
            held.enter_context(lock_run_dir(str(out), API_OUT))
            if not check_api_run_dir(str(out), resume):
                claim_run_dir(str(out), API_OUT)
        except UserError as exc:
            refusal = str(exc)
    refusal = ctx.group.broadcast_object("opening the run directory", refusal)
    if refusal:
        raise UserError(refusal)
