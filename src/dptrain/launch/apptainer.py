"""Apptainer (formerly Singularity): one `apptainer exec` per rank, and the image definition.

Apptainer runs unprivileged from a single .sif file and passes the host environment in, so
the ranks see the scheduler's and the rendezvous variables unchanged; `--nv` binds the
host's NVIDIA driver libraries when the job asks for GPUs.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Mapping, Sequence

from dptrain.launch.spec import JobSpec, bind_paths, quote, train_command

DEFAULT_BASE = "python:3.11-slim"
IMAGE = "IMAGE.sif"  # what follows "apptainer:" in --container


def running_inside(env: Mapping[str, str]) -> bool:
    return "APPTAINER_CONTAINER" in env or "SINGULARITY_CONTAINER" in env


def preamble(spec: JobSpec) -> list[str]:
    return [
        "# Apptainer: older sites call it singularity.",
        "apptainer=$(command -v apptainer || command -v singularity)",
    ]


def wrap(spec: JobSpec) -> str:
    gpu = "--nv " if spec.gpus_per_node > 0 else ""
    binds = ",".join(bind_paths(spec))
    return (f'"$apptainer" exec {gpu}--bind {quote([binds])} --pwd {quote([spec.workdir])} '
            f"{quote([spec.container.image])} {quote(train_command(spec))}")


def definition(base: str = DEFAULT_BASE, torch: str = "torch") -> str:
    return f"""# An Apptainer image holding dptrain and its dependencies. Build it from the project directory:
#   apptainer build dptrain.sif dptrain.def
# then: dptrain launch ... --container apptainer:dptrain.sif -- <train arguments>
# MPI and the scheduler stay on the host; ranks meet over torch.distributed, so no MPI in here.
Bootstrap: docker
From: {base}

%files
    . /opt/dptrain

%post
    export PIP_NO_CACHE_DIR=1
    python -m pip install "{torch}"
    python -m pip install /opt/dptrain

%environment
    export PYTHONUNBUFFERED=1

%runscript
    exec dptrain "$@"
"""


def executable() -> str | None:
    return shutil.which("apptainer") or shutil.which("singularity")


def check(name: str, command: Sequence[str], *, binds: Sequence[str] = ()) -> list[tuple[str, bool, str]]:
    """(what, ok, detail) for: apptainer installed, the image `name` (a .sif file) runs the command."""
    found = executable()
    results = [("apptainer", found is not None, found or "neither apptainer nor singularity is on the PATH")]
    if found:
        bind = ["--bind", ",".join(binds)] if binds else []
        result = subprocess.run([found, "exec", *bind, name, *command], capture_output=True, text=True,
                                timeout=300, stdin=subprocess.DEVNULL)
        lines = (result.stdout + result.stderr).strip().splitlines() or ["no output"]
        results.append((f"runs {' '.join(command)}", result.returncode == 0, lines[-1]))
    return results
