"""The command that starts one rank: `dptrain train` (or the spec's command), inside the spec's container
runtime when it has one; what a runtime adds beside it (launcher options, files); and, before a job is
submitted, its MPI model and the image's MPI against the host's."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from dptrain import registry
from dptrain.cluster.spec import JobSpec, quote, train_command
from dptrain.errors import UserError

# sbatch options that put the batch script itself in a container (pyxis; the CSCS Container Engine).
SBATCH_CONTAINER_OPTIONS = ("--container-", "--environment")


def rank_command(spec: JobSpec) -> tuple[list[str], str]:
    """(set-up lines, command line) that start one rank, inside the spec's container if it has one."""
    if spec.container is None:
        return [], quote(train_command(spec))
    check(spec)
    runtime = registry.load("container runtime", spec.container.runtime)
    return runtime.preamble(spec), runtime.wrap(spec)


def check(spec: JobSpec) -> None:
    """One line for a runtime the spec's scheduler cannot start, or a container asked of sbatch as well."""
    given = f"--container {spec.container.runtime}:{spec.container.image}"
    runtime = registry.load("container runtime", spec.container.runtime)
    if spec.scheduler not in getattr(runtime, "SCHEDULERS", (spec.scheduler,)):
        others = [name for name in registry.names("container runtime") if spec.scheduler in
                  getattr(registry.load("container runtime", name), "SCHEDULERS", (spec.scheduler,))]
        raise UserError(f"{given} starts each rank through {runtime.NEEDS}, which only SLURM jobs have; under "
                        f"--scheduler {spec.scheduler} use one of {', '.join(others)}")
    for line in spec.sbatch_options:
        if line.startswith(SBATCH_CONTAINER_OPTIONS):
            raise UserError(f"--sbatch-option {line!r} with {given}: sbatch would run the whole job script in "
                            "that container, where srun is gone, so no rank could start; drop the "
                            "--sbatch-option, --container starts one container per rank")


def step_options(spec: JobSpec) -> str:
    """srun options (quoted, each followed by a space) that put each task in the container, for a runtime
    that is a plugin of srun (pyxis, the CSCS engine); '' for the others."""
    runtime = registry.load("container runtime", spec.container.runtime) if spec.container else None
    options = runtime.step_options(spec) if hasattr(runtime, "step_options") else []
    return "".join(quote([option]) + " " for option in options)


def files(spec: JobSpec) -> dict[str, str]:
    """Files (name: text) the container runtime needs beside the job script, e.g. the CSCS engine's EDF."""
    runtime = registry.load("container runtime", spec.container.runtime) if spec.container else None
    return runtime.files(spec) if hasattr(runtime, "files") else {}


# ---- the MPI model (checked before a job is submitted) --------------------------------------------

# Open MPI's libmpi.so.40.MINOR.* by release series (Open MPI's shared-library version table): the major
# version of an MPI is read from its library's file name, on the host and in an image alike.
OPEN_MPI_SERIES = {0: 3, 10: 3, 20: 4, 30: 4, 40: 5}
LIBRARY_DIRS = ("usr/lib", "usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/local/lib",
                "lib", "lib64", "opt/*/lib", "usr/lib/*/openmpi/lib", "usr/lib64/openmpi/lib", "usr/lib64/mpich/lib")
LAUNCHERS = {"slurm": "srun", "pbs": "Open MPI's mpirun", "local": "dptrain", "kubernetes": "each pod"}


def mpi_in(root: Path) -> Optional[str]:
    """The MPI a root filesystem ('/' for this host, or an image's) holds: 'Open MPI 4', 'MPICH ABI 12', or None."""
    for pattern in LIBRARY_DIRS:
        for library in sorted(root.glob(f"{pattern}/libmpi.so.*")):
            parts = library.name.split(".")[2:]
            if len(parts) >= 2 and parts[0] == "40" and parts[1].isdigit() and int(parts[1]) in OPEN_MPI_SERIES:
                return f"Open MPI {OPEN_MPI_SERIES[int(parts[1])]}"
            if parts and parts[0] == "12":
                return "MPICH ABI 12"
    return None


def mpi_model(spec: JobSpec, host: Optional[str], image: Optional[str], looked: bool) -> str:
    """One line: who starts the ranks, what they meet over, and the MPI in the image against the host's.
    Raises UserError where a command that may use MPI would run with an image MPI that is not the host's."""
    given = f"--container {spec.container.runtime}:{spec.container.image}"
    start = f"{LAUNCHERS.get(spec.scheduler, spec.scheduler)} starts one container per rank"
    in_image = image or ("no MPI" if looked else "an MPI that cannot be looked into from here")
    if not spec.command:
        return (f"MPI model: {start} and the ranks of dptrain train meet over torch.distributed (gloo, NCCL); "
                f"no MPI is used inside (the image has {in_image})")
    if image and host and image != host:
        raise UserError(f"{given} holds {image} and this host {host}: a program that calls MPI inside the container "
                        f"(the hybrid model, its MPI started through the host's {LAUNCHERS.get(spec.scheduler)}) needs "
                        f"the same MPI and major version on both; build the image with {host}, or add "
                        "--no-mpi-check if your program uses no MPI (torch.distributed only)")
    return (f"MPI model: {start}; your command meets its peers over torch.distributed, or over MPI through the "
            f"host's launcher (the hybrid model), for which the image's MPI ({in_image}) must be the host's "
            f"({host or 'none'})" + (": they match" if image and image == host else ""))


def say_mpi_model(spec: JobSpec, log=print) -> None:
    """Before a container job is submitted: its MPI model in one line, or one line refusing a mismatch."""
    if spec.container is None:
        return
    runtime = registry.load("container runtime", spec.container.runtime)
    root = runtime.image_root(spec.container.image) if hasattr(runtime, "image_root") else None
    log(f"dptrain: {mpi_model(spec, mpi_in(Path('/')), mpi_in(root) if root else None, root is not None)}")
