"""The local launcher: spawn N worker processes on this machine, as torchrun would, but quieter.

Every worker runs `python -m dptrain ARGV` through the one spawner (dptrain.runtime.spawn),
its output prefixed with its rank; workers started ahead of time (dptrain.runtime.prestart)
are given ARGV instead. If any worker fails, the others are stopped and the
launcher exits non-zero with one line naming the failed rank.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from dptrain.runtime.prestart import release
from dptrain.runtime.spawn import Ranks, describe_exit, spawn_ranks, store_listener


def launch_local(workers: int, argv: Sequence[str], timeout: float = 300.0, prestarted: Optional[Ranks] = None) -> int:
    """Run `python -m dptrain ARGV` as `workers` ranks; return 0, 75 (stopped at a checkpoint) or the first failure's code.

    `prestarted`: ranks started by dptrain.runtime.prestart.prestart(workers), released here
    with ARGV (and closed). Once one rank has ended well, the others must end within `timeout`
    seconds (they have no one left to wait for): a rank frozen after the last collective is
    stopped and named.
    """
    try:
        if prestarted is None:
            listener = store_listener()
            ended = spawn_ranks([sys.executable, "-m", "dptrain", *argv], workers, port=listener.getsockname()[1],
                                linger=timeout, listener=listener)
        else:
            try:
                release(prestarted, list(argv), {})
                ended = prestarted.wait(linger=timeout)
            finally:
                prestarted.close()
    except KeyboardInterrupt:
        return 130
    if ended.failed_rank is not None:
        print(f"dptrain: worker rank {ended.failed_rank} {describe_exit(ended.failed_code)}; "
              "stopping the other workers", file=sys.stderr, flush=True)
    if ended.stuck_ranks:
        names = ", ".join(map(str, ended.stuck_ranks))
        print(f"dptrain: worker rank{'s' if len(ended.stuck_ranks) > 1 else ''} {names} had not ended {timeout:g} s "
              f"after rank {ended.first_done} did (frozen or stuck); stopping {'them' if len(ended.stuck_ranks) > 1 else 'it'}",
              file=sys.stderr, flush=True)
    return ended.code
