"""The command that starts one rank: `dptrain train` (or the spec's command), inside the spec's container
runtime when it has one; and what a runtime adds beside it (launcher options, files)."""

from __future__ import annotations

from dptrain import registry
from dptrain.cluster.spec import JobSpec, quote, train_command


def rank_command(spec: JobSpec) -> tuple[list[str], str]:
    """(set-up lines, command line) that start one rank, inside the spec's container if it has one."""
    if spec.container is None:
        return [], quote(train_command(spec))
    runtime = registry.load("container runtime", spec.container.runtime)
    return runtime.preamble(spec), runtime.wrap(spec)


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
