"""Charliecloud: one `ch-run` per rank, on an image directory or a SquashFS file (`ch-convert` makes either).

ch-run keeps the host's environment (ranks, rendezvous) and the host's network, and runs as the user;
it needs $USER. It mounts a bind only where its destination exists in the image and makes none in a
read-only one, so for a directory image the job script makes them first; a SquashFS image must have
them built in. GPUs: `ch-fromhost --nvidia IMAGE` copies the host's driver libraries into a directory
image once; ch-run has no flag for them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Mapping, Optional, Sequence

from dptrain.cluster.spec import JobSpec, bind_paths, quote, train_command

IMAGE = "IMAGE_DIR_OR.sqfs"  # what follows "charliecloud:"


def running_inside(env: Mapping[str, str]) -> bool:
    """ch-run sets CH_RUNNING in every container."""
    return "CH_RUNNING" in env


def destinations(spec: JobSpec) -> list[str]:
    return [path.split(":", 1)[1] if ":" in path else path for path in bind_paths(spec)]


def preamble(spec: JobSpec) -> list[str]:
    image = quote([spec.container.image])
    made = " ".join(quote([f"{spec.container.image.rstrip('/')}{path}"]) for path in destinations(spec))
    gpu = (["# GPUs: the image holds the host's NVIDIA libraries once 'ch-fromhost --nvidia IMAGE' has run."]
           if spec.gpus_per_node > 0 else [])
    return ["# Charliecloud: ch-run needs $USER, and mounts a bind only where the image has its destination;",
            "# in a directory image they are made here (a SquashFS image must have them built in).",
            *gpu,
            'export USER="${USER:-$(id -un)}"',
            f"if [ -d {image} ]; then mkdir -p {made}; fi"]


def wrap(spec: JobSpec) -> str:
    binds = [word for path in bind_paths(spec) for word in ("-b", path)]
    return quote(["ch-run", *binds, "-c", spec.workdir, spec.container.image, "--", *train_command(spec)])


def image_root(image: str) -> Optional[Path]:
    """A directory image is its root filesystem; a SquashFS file cannot be looked into without mounting it."""
    return Path(image) if Path(image).is_dir() else None


def check(name: str, command: Sequence[str], *, binds: Sequence[str] = ()) -> list[tuple[str, bool, str]]:
    """(what, ok, detail) for: ch-run installed, the image `name` runs the command."""
    found = shutil.which("ch-run")
    results = [("ch-run", found is not None, found or "not on the PATH (Debian: apt-get install charliecloud)")]
    if found:
        bind = [word for path in binds for word in ("-b", path)]
        result = subprocess.run([found, *bind, name, "--", *command], capture_output=True, text=True, timeout=300,
                                stdin=subprocess.DEVNULL)
        lines = (result.stdout + result.stderr).strip().splitlines() or ["no output"]
        results.append((f"runs {' '.join(command)}", result.returncode == 0, lines[-1]))
    return results
