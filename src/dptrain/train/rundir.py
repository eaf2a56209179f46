"""The run directory: resolved config, metrics.jsonl, summary.json, model.pt. Never overwrites a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml

from dptrain.errors import UserError
from dptrain.io import make_dirs, timestamped

RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "model.pt")


def default_run_dir(strategy: str, job_id: Optional[str] = None) -> str:
    """runs/STRATEGY-JOBID under a scheduler (so a restarted job finds its run), else a timestamp."""
    return timestamped("runs", strategy, job_id if job_id and job_id != "none" else None)


# Settings that may change between an interrupted run and its continuation.
RESUMABLE_CHANGES = {"out", "resume", "progress", "timeout", "epochs", "max_restarts", "checkpoint_every",
                     "keep_checkpoints"}


def claim_run_dir(path: str) -> Path:
    """Create `path` for a new run, refusing one that already holds a run's files."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"run directory '{path}' is a file; give --out a new directory")
    held = [name for name in RUN_FILES if (directory / name).exists()]
    if held:
        raise UserError(f"run directory '{path}' already holds a run ({', '.join(held)}); give --out a new directory")
    try:
        make_dirs(directory)
    except OSError as exc:
        raise UserError(f"cannot create run directory '{path}': {exc.strerror}") from None
    return directory


def open_run_dir(path: str, settings: dict[str, Any], resume: bool = False) -> tuple[Path, bool]:
    """(run directory, whether it continues an interrupted run with the same settings).

    A new directory is created; a finished run (summary.json) is refused; an unfinished run
    with the same settings is continued from its checkpoints; different settings are refused,
    naming the first difference. Nothing on disk is overwritten before that decision.
    """
    directory = Path(path)
    saved = directory / "config.yaml"
    if (directory / "summary.json").exists():
        raise UserError(f"run directory '{path}' holds a finished run (summary.json); give --out a new directory")
    if not saved.exists():
        if resume:
            raise UserError(f"--resume: run directory '{path}' holds no run to continue")
        return claim_run_dir(path), False
    previous = yaml.safe_load(saved.read_text()) or {}
    for key, value in settings.items():
        if key not in RESUMABLE_CHANGES and previous.get(key) != value:
            raise UserError(f"run directory '{path}' holds a run with other settings ({key}: {previous.get(key)!r} "
                            f"there, {value!r} now); give --out a new directory, or the same settings to continue it")
    if resume and not (directory / "checkpoints").is_dir():
        raise UserError(f"--resume: run directory '{path}' has no checkpoint yet")
    return directory, True
