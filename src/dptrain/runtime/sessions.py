"""Ranks in sessions of their own that end with their launcher.

torchrun's agent starts each worker in a session of its own, and `dptrain train`'s launcher does too
(`start_ranks(sessions=True)`): under Linux's autogroup scheduling each session is scheduled as one group, so
the ranks' threads are not lumped with the launcher's and each other's (measured: about 0.9 ms less per 15 ms
step of two sharded ranks on 2 cores, benchmarks/README section 27). A rank in a session of its own is no
longer killed with the launcher's process group, so it asks the kernel to kill it when its launcher ends
(`die_with_launcher`, Linux's parent-death signal).

Nothing here imports more than the standard library: `python -m dptrain` calls it first thing.
"""

from __future__ import annotations

import os
import signal
import sys

# A `dptrain train` worker in a session of its own: its launcher's pid, whose end ends it (`die_with_launcher`).
LAUNCHER_PID = "DPTRAIN_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_launcher() -> None:
    """In a rank started in a session of its own (`start_ranks(sessions=True)`): be killed when the launcher that
    started it ends (Linux's parent-death signal), as a rank in the launcher's own process group is when the
    group is killed; exit at once if the launcher is gone already. Elsewhere (another OS, no prctl) nothing."""
    launcher = os.environ.pop(LAUNCHER_PID, None)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != launcher:  # it ended before the signal was asked for
        os._exit(1)
