"""Files dptrain writes: every one atomically (temporary file, fsync, rename), and run-directory names.

A reader never sees half a file under its real name, and a crash leaves either the old file or
the new one. JSON, JSON lines and torch-saved files all go through `atomic_write_bytes`. A disk
that is full or refuses writes is the user's to fix, not a bug: it becomes one line (DiskError,
exit code 2) naming the file and the cause, and the temporary file is removed again.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any

from dptrain import faults
from dptrain.errors import UserError

# Causes a user can fix (free space, raise the quota, choose a writable --out), in their words.
DISK_CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


class DiskError(UserError):
    """A file or directory could not be written because of the disk, not because of dptrain."""


FULL = (errno.ENOSPC, errno.EDQUOT)  # the others of DISK_CAUSES: the directory refuses writes, whatever the space


def disk_error(exc: OSError, what: str) -> Exception:
    """`exc` as a DiskError naming `what` (e.g. "cannot write 'run/config.yaml'"), or `exc` itself.

    A full disk or quota asks for space; a read-only or forbidden directory names that directory (the one the
    file or directory was to be made in), which no freeing of space would help."""
    cause = DISK_CAUSES.get(exc.errno)
    if cause is None:
        return exc
    if exc.errno in FULL:
        return DiskError(f"{what}: {cause}; free space (or give --out a directory on another disk) and run the same "
                         "command again")
    directory = os.path.dirname(os.fsdecode(exc.filename)) or "." if exc.filename else None
    named = f"the directory '{directory}'" if directory else "the output directory"
    return DiskError(f"{what}: {cause}, {named} is not writable; give --out a writable directory")


UMASK_ENV = "DPTRAIN_UMASK"  # octal; default 077: a run's files are its user's alone (027 shares them with the group)


def umask() -> int:
    """The umask dptrain writes with: DPTRAIN_UMASK (octal, e.g. 027), else 077."""
    try:
        return int(os.environ.get(UMASK_ENV, "077"), 8) & 0o777
    except ValueError:
        raise UserError(f"{UMASK_ENV}={os.environ[UMASK_ENV]!r} is not an octal umask; give e.g. 077 (files private to "
                        "you, the default) or 027 (readable by your group)") from None


def private_files() -> None:
    """Make every file this process (and what it starts) writes private to its user, unless DPTRAIN_UMASK
    says otherwise: run directories, checkpoints, metrics, plots, logs and join.address (the run's secret)."""
    os.umask(umask())


def open_private(path: Path, flags: int, mode: str, **options: Any):
    """open() with the file created 0600 (or as DPTRAIN_UMASK says), whatever the process's umask."""
    return os.fdopen(os.open(path, flags | os.O_CREAT, 0o666 & ~umask()), mode, **options)


def make_dirs(path: Path) -> None:
    """mkdir -p (the last directory 0700 unless DPTRAIN_UMASK says otherwise), with a full or read-only disk
    reported as a DiskError."""
    try:
        Path(path).mkdir(mode=0o777 & ~umask(), parents=True, exist_ok=True)
    except OSError as exc:
        raise disk_error(exc, f"cannot create directory '{path}'") from None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` by `data`: written to PATH.RANDOM.tmp, flushed to disk, renamed over PATH. The
    temporary name is this write's own (O_EXCL): two processes writing one path at once each rename a
    whole file, the last one wins, and neither finds its temporary file taken by the other."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open_private(tmp, os.O_WRONLY | os.O_EXCL, "wb") as handle:
            handle.write(data)
            handle.flush()
            faults.point("save-fsync")
            os.fsync(handle.fileno())
        faults.point("save-rename")
        os.replace(tmp, path)
    except OSError as exc:
        # A half-written temporary file would hold the very space the user must free.
        try:
            tmp.unlink()
        except OSError:
            pass
        raise disk_error(exc, f"cannot write '{path}'") from None


def write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def to_json(data: Any, indent: int | None = None) -> str:
    """`data` as JSON text, a NaN or infinite float written as null: JSON has no such numbers, and the NaN
    that Python's json writes by default makes the file unreadable to other JSON readers (jq, browsers)."""
    try:
        return json.dumps(data, indent=indent, allow_nan=False)
    except ValueError:
        return json.dumps(_finite_or_null(data), indent=indent, allow_nan=False)


def _finite_or_null(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite_or_null(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite_or_null(value) for value in data]
    return data


def write_json(path: Path, data: Any) -> None:
    write_text(path, to_json(data, indent=2) + "\n")


def write_jsonl(path: Path, records: list[dict]) -> None:
    """Replace a JSON-lines file with `records`."""
    write_text(path, "".join(to_json(record) + "\n" for record in records))


def append_jsonl(path: Path, record: dict) -> None:
    """Add one record to a JSON-lines file, flushed to disk. Appending, not rewriting: the cost of a
    record stays the same however long the run. A crash can leave at most a partial last line, and a
    resumed run rewrites the file whole from its checkpoint's history (write_jsonl)."""
    try:
        with open_private(path, os.O_WRONLY | os.O_APPEND, "ab") as handle:
            handle.write((to_json(record) + "\n").encode())
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise disk_error(exc, f"cannot write '{path}'") from None


def save_torch(path: Path, obj: Any) -> bytes:
    """torch.save `obj` to `path` atomically; return the bytes written (for a checksum)."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    atomic_write_bytes(path, data)
    return data


def timestamped(parent: str, prefix: str, suffix: str | None = None) -> str:
    """PARENT/PREFIX-SUFFIX, the suffix defaulting to the current time (YYYYmmdd-HHMMSS)."""
    return os.path.join(parent, f"{prefix}-{suffix or time.strftime('%Y%m%d-%H%M%S')}")
