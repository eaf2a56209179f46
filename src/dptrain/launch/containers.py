"""The container runtimes by name, and which one (if any) this process runs in."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Mapping, Optional

from dptrain.launch import apptainer, udocker
from dptrain.launch.spec import quote, train_command

RUNTIMES: dict[str, ModuleType] = {"udocker": udocker, "apptainer": apptainer}


def detect(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The runtime whose marker variables are set, or None outside containers."""
    env = os.environ if env is None else env
    return next((name for name, module in RUNTIMES.items() if module.running_inside(env)), None)


def rank_command(spec) -> tuple[list[str], str]:
    """(set-up lines, command line) that start one rank, inside the spec's container if it has one."""
    if spec.container is None:
        return [], quote(train_command(spec))
    runtime = RUNTIMES[spec.container.runtime]
    return runtime.preamble(spec), runtime.wrap(spec)
