"""CSCS Alps' Container Engine: an environment definition file (EDF, TOML) and `srun --environment=EDF`.

dptrain writes the EDF (`edf.toml`, beside the job script: the image, the binds as mounts, the working
directory) and the step's srun gets `--environment` with its path; srun starts every task in that
environment, with the task's environment passed in. IMAGE may also be an EDF of the user's own (a name
in ~/.edf or a path, ending in .toml), used as it is. GPUs are the engine's to give; with
--gpus-per-node the EDF turns on the NCCL hook (annotations) that brings the host's network plugin in.
Only SLURM has it.
"""

from __future__ import annotations

import json
import posixpath
import shutil
from typing import Mapping, Sequence

from dptrain.cluster.spec import JobSpec, bind_paths, quote, train_command

IMAGE = "IMAGE"  # what follows "cscs-edf:": an image (nvcr.io#nvidia/pytorch:24.05-py3, a .sqsh file) or ENV.toml
SCHEDULERS = ("slurm",)
NEEDS = "srun's --environment (the Container Engine's SLURM plugin)"
EDF_NAME = "edf.toml"


def running_inside(env: Mapping[str, str]) -> bool:
    """The engine (enroot underneath) leaves no variable of its own in the container, so a rank cannot tell."""
    return False


def own_environment(spec: JobSpec) -> bool:
    """Whether IMAGE names the user's own EDF rather than an image."""
    return spec.container.image.endswith(".toml")


def environment(spec: JobSpec) -> str:
    return spec.container.image if own_environment(spec) else posixpath.join(spec.run_dir, EDF_NAME)


def edf(spec: JobSpec) -> str:
    """The EDF: TOML, its strings written as JSON's (a subset of TOML's basic strings)."""
    mounts = [path if ":" in path else f"{path}:{path}" for path in bind_paths(spec)]
    lines = ["# Written by dptrain launch beside the job script, which runs srun --environment with it.",
             f"image = {json.dumps(spec.container.image)}",
             f"mounts = [{', '.join(json.dumps(mount) for mount in mounts)}]",
             f"workdir = {json.dumps(spec.workdir)}",
             "writable = true"]
    if spec.gpus_per_node:
        lines += ["", "[annotations]", 'com.hooks.aws_ofi_nccl.enabled = "true"',
                  'com.hooks.aws_ofi_nccl.variant = "cuda12"']
    return "\n".join(lines) + "\n"


def files(spec: JobSpec) -> dict[str, str]:
    """Files dptrain launch writes beside the job script: the EDF, unless the user gave their own."""
    return {} if own_environment(spec) else {EDF_NAME: edf(spec)}


def step_options(spec: JobSpec) -> list[str]:
    return [f"--environment={environment(spec)}"]


def preamble(spec: JobSpec) -> list[str]:
    where = "the user's own EDF" if own_environment(spec) else f"the EDF {EDF_NAME} beside this script"
    return [f"# Container Engine: srun starts every task in the environment of {where}."]


def wrap(spec: JobSpec) -> str:
    return quote(train_command(spec))


def check(name: str, command: Sequence[str], *, binds: Sequence[str] = ()) -> list[tuple[str, bool, str]]:
    """(what, ok, detail): the engine is part of the cluster's srun; only srun can be found from here."""
    srun = shutil.which("srun")
    return [("srun", srun is not None, srun or "not on the PATH; the Container Engine runs only through srun on Alps")]
