"""What a scheduler, a launcher and a container runtime module provide: one module each, registered by
name in dptrain.registry, checked against these Protocols by tests/test_registry.py.

Rendering is pure (a function of the JobSpec, tested as text); submitting, polling and checking
run processes, and are kept apart from it. The in-job side (`job`, `ranks`) is a pure function of
an environment mapping, so each is tested from a synthetic environment; dptrain.runtime.env asks
every registered scheduler and launcher, in the order of their PRIORITY, and combines the answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Protocol, Sequence, runtime_checkable

from dptrain.cluster.spec import JobSpec
from dptrain.cluster.submit import JobStatus
from dptrain.errors import UserError


@dataclass(frozen=True)
class Job:
    """The scheduler job this process runs in: the scheduler's name, the job's id, its nodes (first: rank 0's)."""

    scheduler: str
    job_id: str
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Placement:
    """Who started this process as one rank of many, and where it sits among them."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def integer(env: Mapping[str, str], name: str) -> int:
    """The integer value of environment variable `name`; one line naming it when it is not one."""
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


@runtime_checkable
class Environment(Protocol):
    """A launcher's in-job side: the variables it gives each rank it starts.

    A launcher module may also define `launch_id(env) -> Optional[str]`: an id every rank of one
    launch shares (e.g. Open MPI's job id), from which the rendezvous port is derived when no
    scheduler job gives one.
    """

    PRIORITY: int  # the order asked in (lowest first): where two launchers' variables are both set, the first wins

    def ranks(self, env: Mapping[str, str]) -> Optional[Placement]:
        """Rank, world and local rank when this launcher started the process, else None."""


@runtime_checkable
class Scheduler(Protocol):
    """A batch system (or this machine): writes the job script, submits it, reports the job's state, and
    tells from the environment whether a process runs inside one of its jobs.

    A scheduler whose jobs write no output file into the run directory (Kubernetes: the pods' logs) may
    also define `describe_output(job_id) -> str`, where `dptrain launch --submit` says the output goes. One
    whose jobs requeue themselves as a new job (PBS) defines `requeued_as(run_dir, job_id) -> Optional[str]`,
    the id `dptrain launch --wait` follows next. One whose ranks do not see the launching machine's files
    (Kubernetes: the image and its volumes) defines `expected_files(spec) -> list[str]`, a sentence for each
    file they read saying where it must be, which `dptrain launch` prints instead of checking the files here.
    """

    SCRIPT_NAME: str  # the job script's file name in the run directory, e.g. job.slurm
    SUBMIT_COMMAND: str  # what submits (or, locally, runs) the script, e.g. sbatch, kubectl apply -f
    PRIORITY: int  # as Environment.PRIORITY, for `ranks`; `job` is asked in the same order

    def render(self, spec: JobSpec) -> str:
        """The whole job script: one rank (or one container) per task, rendezvous from the scheduler."""

    def submit(self, script: Path) -> str:
        """Submit the written script; returns the job id."""

    def poll(self, job_id: str) -> JobStatus:
        """The job's state now, and its exit code once finished."""

    def output_path(self, run_dir: Path, job_id: str) -> Path:
        """The file the job's output goes to, followed by `dptrain launch --wait`."""

    def job(self, env: Mapping[str, str]) -> Optional[Job]:
        """The job when the environment is that of a process inside one of this scheduler's jobs, else None."""

    def ranks(self, env: Mapping[str, str]) -> Optional[Placement]:
        """Rank and world when the scheduler's own launcher (e.g. srun) started the process, else None."""


@runtime_checkable
class ContainerRuntime(Protocol):
    """A rootless container runtime that each rank of a job runs in.

    A runtime that is a plugin of srun (pyxis, the CSCS Container Engine) also defines `SCHEDULERS` (the
    schedulers that can start it; the others refuse it in one line naming `NEEDS`, what it runs through)
    and `step_options(spec) -> list[str]`, the srun options that start each task in the container, its
    `wrap` being the plain command. One that needs files beside the job script (the CSCS engine's EDF)
    defines `files(spec) -> dict[str, str]`, name to text, which `dptrain launch` writes there.
    """

    IMAGE: str  # what --container RUNTIME:IMAGE names, e.g. IMAGE.sif

    def running_inside(self, env: Mapping[str, str]) -> bool:
        """Whether an environment is that of a process this runtime started (for `dptrain info`)."""

    def preamble(self, spec: JobSpec) -> list[str]:
        """Script lines, run once before the ranks start, that the rank command needs."""

    def wrap(self, spec: JobSpec) -> str:
        """The shell command that runs one rank's `dptrain train` (or the spec's command) in the spec's container."""

    def check(self, name: str, command: Sequence[str], *, binds: Sequence[str] = ()) -> list[tuple[str, bool, str]]:
        """(what, ok, detail) rows for `dptrain container check`: installed, and `command` runs inside `name`."""
