"""Apptainer (formerly Singularity): one `apptainer exec` per rank, and the image definition.

Apptainer runs unprivileged from a single .sif file and passes the host environment in, so
the ranks see the scheduler's and the rendezvous variables unchanged; `--nv` binds the
host's NVIDIA driver libraries when the job asks for GPUs.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Mapping, Sequence

from dptrain.cluster.spec import JobSpec, bind_paths, quote, train_command
from dptrain.cluster.udocker import SOURCE_FILES, torch_install

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


def definition(base: str = DEFAULT_BASE, torch: str = "torch", *, wheel: str | None = None,
               build: str = "apptainer build dptrain.sif dptrain.def", torch_index_url: str | None = None) -> str:
    """An Apptainer definition installing dptrain from the source tree or, with `wheel`, from that
    wheel (torch from `torch_index_url` when given). %files paths are relative to where `build`
    (shown in the header) runs."""
    pip_torch = torch_install(torch, torch_index_url)
    if wheel:
        where = (f"Its %files is the wheel\n# {wheel}, in the directory holding this file (no dptrain "
                 "source tree is needed).\n# In that directory:")
        files = f"    {wheel} /opt/dptrain/{wheel}"
        target = f"/opt/dptrain/{wheel}"
    else:
        where = ("Its %files come from the dptrain\n# source tree (pyproject.toml, README.md, src/; with "
                 "dptrain installed but no source\n# tree, rerun the recipe with --wheel). In the source tree:")
        files = "\n".join(f"    {name} /opt/dptrain/{name}" for name in SOURCE_FILES)
        target = "/opt/dptrain"
    return f"""# An Apptainer image holding dptrain and its dependencies. {where}
#   {build}
# then: dptrain launch ... --container apptainer:dptrain.sif -- <train arguments>
# MPI and the scheduler stay on the host; ranks meet over torch.distributed, so no MPI in here.
Bootstrap: docker
From: {base}

%files
{files}

%post
    export PIP_NO_CACHE_DIR=1
    python -m pip install {pip_torch}
    python -m pip install {target}
    # Your own packages (what your --data and --model files or your script import) go here, pinned, e.g.
    # python -m pip install scikit-learn==1.6.1

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
