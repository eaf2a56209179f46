"""`python -m dptrain` (and `torchrun -m dptrain`): the same as the `dptrain` command."""

import os
import sys

if os.environ.get("DPTRAIN_LAUNCHER_PID"):
    # A worker of `dptrain train --workers N`, in a session of its own: it ends with its launcher.
    from dptrain.runtime.sessions import die_with_launcher

    die_with_launcher()

if os.environ.get("DPTRAIN_PRESTARTED") == "1":
    # A local worker started before its launcher validated the run: it imports torch now and
    # takes its arguments from the launcher's line (dptrain.runtime.prestart).
    from dptrain.cli import wait_for_launcher

    wait_for_launcher()

if sys.argv[1:2] == ["train"]:
    # Before anything heavy is imported: a scheduler's stop signal that arrives while this rank
    # starts up is remembered and honoured at the first epoch end instead of killing it.
    from dptrain.train.preemption import catch_stop_signals_early

    catch_stop_signals_early()

from dptrain.cli import entry  # noqa: E402 - after the signal handlers, on purpose

entry()
