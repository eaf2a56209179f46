"""The command that starts one rank: `dptrain train` (or the spec's command), inside the spec's container
runtime when it has one; and what a runtime adds beside it (launcher options, files)."""

from __future__ import annotations

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
