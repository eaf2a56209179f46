"""What a scheduler backend and a container runtime backend provide: one module each, registered by name
in dptrain.registry, checked against these Protocols by tests/test_registry.py.

Rendering is pure (a function of the JobSpec, tested as text); submitting, polling and checking
run processes, and are kept apart from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Protocol, Sequence, runtime_checkable

from dptrain.launch.spec import JobSpec
from dptrain.launch.submit import JobStatus


@runtime_checkable
class Scheduler(Protocol):
    """A batch system (or this machine): writes the job script, submits it, reports the job's state."""

    SCRIPT_NAME: str  # the job script's file name in the run directory, e.g. job.slurm
    SUBMIT_COMMAND: str  # the program that submits (or, locally, runs) the script, e.g. sbatch

    def render(self, spec: JobSpec) -> str:
        """The whole job script: one rank (or one container) per task, rendezvous from the scheduler."""

    def submit(self, script: Path) -> str:
        """Submit the written script; returns the job id."""

    def poll(self, job_id: str) -> JobStatus:
        """The job's state now, and its exit code once finished."""

    def output_path(self, run_dir: Path, job_id: str) -> Path:
        """The file the job's output goes to, followed by `dptrain launch --wait`."""


@runtime_checkable
class ContainerRuntime(Protocol):
    """A rootless container runtime that each rank of a job runs in."""

    IMAGE: str  # what --container RUNTIME:IMAGE names, e.g. IMAGE.sif

    def running_inside(self, env: Mapping[str, str]) -> bool:
        """Whether an environment is that of a process this runtime started (for `dptrain info`)."""

    def preamble(self, spec: JobSpec) -> list[str]:
        """Script lines, run once before the ranks start, that the rank command needs."""

    def wrap(self, spec: JobSpec) -> str:
        """The shell command that runs one rank's `dptrain train` (or the spec's command) in the spec's container."""

    def check(self, name: str, command: Sequence[str], *, binds: Sequence[str] = ()) -> list[tuple[str, bool, str]]:
        """(what, ok, detail) rows for `dptrain container check`: installed, and `command` runs inside `name`."""
