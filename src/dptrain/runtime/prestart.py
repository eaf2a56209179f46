"""Local workers started before the run is validated, so they import torch while the launcher checks the input.

`dptrain train --workers N` checks everything a user can get wrong in the launching process
before any worker trains (bad input fails once, in one line). Each worker must also import
torch and the rest of the runtime, about two seconds of CPU apiece, and both used to happen
one after the other. Now the launcher starts the N workers first (`prestart`, before it
imports torch itself): each imports what every rank needs (`wait_for_launcher`) and then
waits for one line on its stdin, the `dptrain` arguments and the environment of the run
(`release`). Bad input, Ctrl-C or a dead launcher close that stdin without a line; the waiting
worker then exits at once and silently (the launcher kills one still importing). A worker has
no deadline of its own while it waits: its launcher is busy validating (which may read a whole
data file) or gone, and gone closes the pipe.

Nothing here imports torch: the launcher calls `prestart` before it does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Optional

from dptrain.runtime.spawn import Ranks, start_ranks, store_listener

PRESTARTED = "DPTRAIN_PRESTARTED"  # set in a pre-started worker's environment until it is released


def quiet_cpp_logs_of_children() -> None:
    """Keep torch's C++ warnings with stacks out of the workers this process is about to start.

    When rank 0 dies, a survivor's store connection logs a 20-line C++ stack before dptrain's
    one line. torch reads TORCH_CPP_LOG_LEVEL once, at import, so it is set in the environment
    the workers inherit, not in a running rank; a value the user set is kept.
    """
    if os.environ.get("DPTRAIN_DEBUG") != "1":
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def prestart(workers: int) -> Ranks:
    """Start `workers` local ranks of `python -m dptrain` that import the runtime and wait for `release`."""
    quiet_cpp_logs_of_children()
    listener = store_listener()  # rank 0 serves the store on it: the port stays taken from now on
    return start_ranks([sys.executable, "-m", "dptrain"], workers, port=listener.getsockname()[1],
                       extra_env={PRESTARTED: "1"}, held=True, listener=listener)


def release(ranks: Ranks, argv: list[str], env: dict[str, str]) -> None:
    """Let pre-started ranks run `dptrain ARGV` with `env` added to their environment."""
    ranks.release(json.dumps({"argv": list(argv), "env": env}).encode())


def wait_for_launcher() -> None:
    """In a pre-started worker: import the runtime, then take sys.argv and environment from the launcher's line.

    Without a line (stdin closed: the launcher refused the input, was interrupted or died) the
    process exits here with nothing said. Ctrl-C, which reaches the whole process group, is
    left to the launcher until the release: it reports it and stops this process.
    """
    # start_ranks(held=True) started this process with SIGINT, SIGTERM and SIGUSR1 blocked, so
    # that none of them ends it during the interpreter's own start-up: now a Ctrl-C that came
    # meanwhile is dropped, and a stop signal is remembered, to be honoured at the first epoch end.
    previous_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
    from dptrain.train.preemption import STOP_SIGNALS, catch_stop_signals_early

    catch_stop_signals_early()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, *STOP_SIGNALS})
    os.environ.pop(PRESTARTED, None)  # not inherited by whatever this worker starts
    _preload()
    line: Optional[bytes] = sys.stdin.buffer.readline()
    if not line:
        os._exit(0)
    signal.signal(signal.SIGINT, previous_sigint)
    message = json.loads(line)
    os.environ.update(message["env"])
    sys.argv[1:] = message["argv"]
    null = os.open(os.devnull, os.O_RDONLY)  # the worker's stdin from now on, as for any spawned rank
    os.dup2(null, 0)
    os.close(null)


def _preload() -> None:
    """Import what every `dptrain train` rank imports anyway; a failure is left to happen again where it would."""
    try:
        import dptrain.cli  # noqa: F401
        import dptrain.train.run  # noqa: F401 - torch, torch.distributed, the trainer
        import torch._dynamo  # noqa: F401 - torch.optim imports it when the first optimizer is made (~1 s)
    except Exception:  # noqa: BLE001
        pass
