"""enroot through SLURM's pyxis plugin: srun itself puts each task in the container (`--container-image`).

No program wraps the rank: the container options go on the job step's srun line (`step_options`), and
the task inside runs `dptrain train` as it would on the host. pyxis passes the task's environment in
(ranks, rendezvous) and the site's enroot hooks mount the GPUs a step is given, so nothing is added for
--gpus-per-node. Only SLURM has it.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Mapping, Sequence

from dptrain.cluster.spec import JobSpec, bind_paths, quote, train_command

IMAGE = "IMAGE"  # what follows "pyxis:": an enroot URI (nvcr.io#nvidia/pytorch:24.05-py3) or a .sqsh file
SCHEDULERS = ("slurm",)
NEEDS = "srun's pyxis plugin"


def running_inside(env: Mapping[str, str]) -> bool:
    """enroot leaves no variable of its own in the container, so a rank cannot tell."""
    return False


def mounts(spec: JobSpec) -> str:
    """pyxis' mount list: SRC:DST each (it takes no bare SRC), comma-separated."""
    return ",".join(path if ":" in path else f"{path}:{path}" for path in bind_paths(spec))


def step_options(spec: JobSpec) -> list[str]:
    """srun options that start every task of the step in the image. A named container is imported once
    per node and job, and reused by the job's later steps."""
    return [f"--container-image={spec.container.image}", f"--container-mounts={mounts(spec)}",
            f"--container-workdir={spec.workdir}", f"--container-name={spec.job_name}"]


def preamble(spec: JobSpec) -> list[str]:
    return ["# pyxis: srun imports the image on each node (enroot) and starts every task in it; the container",
            f"# named {spec.job_name} is kept for the job's later steps."]


def wrap(spec: JobSpec) -> str:
    return quote(train_command(spec))


def check(name: str, command: Sequence[str], *, binds: Sequence[str] = ()) -> list[tuple[str, bool, str]]:
    """(what, ok, detail): pyxis is a plugin of the cluster's srun; only its options can be seen from here."""
    srun = shutil.which("srun")
    if srun is None:
        return [("srun", False, "not on the PATH; pyxis runs only through a SLURM cluster's srun")]
    result = subprocess.run([srun, "--help"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    found = "--container-image" in result.stdout + result.stderr
    return [("srun", True, srun),
            ("pyxis plugin", found, "srun --help lists --container-image" if found else
             "srun --help lists no --container-image: this cluster's SLURM has no pyxis plugin")]
