"""Local workers started before the run is validated, so they import torch while the launcher checks the input.

`dptrain train --workers N` checks everything a user can get wrong in the launching process
before any worker trains (bad input fails once, in one line). Each worker must also import
torch and the rest of the runtime, about two seconds of CPU apiece, and both used to happen
one after the other. Now the launcher starts the N workers first (`prestart`, before it
imports torch itself): each imports what every rank needs (dptrain.cli.wait_for_launcher) and
then waits for one line on its stdin (`receive`): the `dptrain` arguments and the environment
of the run (`release`). Bad input, Ctrl-C or a dead launcher close that stdin without a line;
the waiting worker then exits at once and silently (the launcher kills one still importing). A
worker has no deadline of its own while it waits: its launcher is busy validating (which may
read a whole data file) or gone, and gone closes the pipe. Rank 0 also inherits the socket
its store will listen on (dptrain.runtime.spawn.store_listener).

Nothing here imports torch: the launcher calls `prestart` before it does.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from dptrain.runtime.spawn import PRESTARTED, Ranks, start_ranks, store_listener


def quiet_cpp_logs_of_children() -> None:
    """Keep torch's C++ warnings with stacks out of the workers this process is about to start.

    When rank 0 dies, a survivor's store connection logs a 20-line C++ stack before dptrain's
    one line. torch reads TORCH_CPP_LOG_LEVEL once, at import, so it is set in the environment
    the workers inherit, not in a running rank; a value the user set is kept.
    """
    if os.environ.get("DPTRAIN_DEBUG") != "1":
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def prestart(workers: int, serve_store: bool = False) -> Ranks:
    """Start `workers` local ranks of `python -m dptrain` that import the runtime and wait for `release`.
    `serve_store`: the launcher is to serve their store (Ranks.serve_store, before `release`), not rank 0."""
    quiet_cpp_logs_of_children()
    listener = store_listener()  # the store listens on it: the port stays taken from now on
    return start_ranks([sys.executable, "-m", "dptrain"], workers, port=listener.getsockname()[1],
                       extra_env={PRESTARTED: "1"}, held=True, listener=listener, serve_store=serve_store,
                       sessions=True)


def release(ranks: Ranks, argv: list[str], env: dict[str, str]) -> None:
    """Let pre-started ranks run `dptrain ARGV` with `env` added to their environment."""
    ranks.release(json.dumps({"argv": list(argv), "env": env}).encode())


def receive() -> Optional[list[str]]:
    """In a pre-started rank: wait for the launcher's line; the `dptrain` arguments it gives, its
    environment applied, or None when stdin closed without a line (the run is not going ahead)."""
    os.environ.pop(PRESTARTED, None)  # not inherited by whatever this worker starts
    line = sys.stdin.buffer.readline()
    if not line:
        return None
    message = json.loads(line)
    os.environ.update(message["env"])
    null = os.open(os.devnull, os.O_RDONLY)  # the worker's stdin from now on, as for any spawned rank
    os.dup2(null, 0)
    os.close(null)
    return list(message["argv"])
