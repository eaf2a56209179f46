"""The run directory: resolved config, metrics.jsonl, summary.json, model.pt. Never overwrites a run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from dptrain.errors import UserError

RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "model.pt")


def default_run_dir(strategy: str) -> str:
    return os.path.join("runs", f"{strategy}-{time.strftime('%Y%m%d-%H%M%S')}")


def claim_run_dir(path: str) -> Path:
    """Create `path` for a new run, refusing one that already holds a run's files."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"run directory '{path}' is a file; give --out a new directory")
    held = [name for name in RUN_FILES if (directory / name).exists()]
    if held:
        raise UserError(f"run directory '{path}' already holds a run ({', '.join(held)}); give --out a new directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create run directory '{path}': {exc.strerror}") from None
    return directory


def write_text_atomic(path: Path, text: str) -> None:
    """Write a file atomically (temporary file, then rename) so readers never see half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
