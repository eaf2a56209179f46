"""The command that starts one rank: `dptrain train` (or the spec's command), inside the spec's container
runtime when it has one."""

from __future__ import annotations

from dptrain import registry
from dptrain.cluster.spec import JobSpec, quote, train_command


def rank_command(spec: JobSpec) -> tuple[list[str], str]:
    """(set-up lines, command line) that start one rank, inside the spec's container if it has one."""
    if spec.container is None:
        return [], quote(train_command(spec))
    runtime = registry.load("container runtime", spec.container.runtime)
    return runtime.preamble(spec), runtime.wrap(spec)
