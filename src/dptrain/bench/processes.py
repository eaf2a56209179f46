"""Start the ranks of one benchmark run (any command: dptrain, a baseline script), each possibly in its own namespace.

A benchmark also runs baseline scripts and places ranks in emulated hosts, so it gives the one
spawner (dptrain.runtime.spawn) its own command and per-rank prefix, and keeps each rank's
output in a log file of the run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

from dptrain.errors import UserError
from dptrain.runtime.spawn import describe_exit, spawn_ranks


class RunFailed(UserError):
    """A rank of a benchmark run failed or ran out of time (one line naming the rank and its log, exit code 1)."""

    exit_code = 1


def run_ranks(command: Sequence[str], world: int, log_dir: Path, *, port: int, master_addr: str = "127.0.0.1",
              prefix: Optional[Callable[[int], list[str]]] = None, extra_env: Optional[dict] = None,
              threads: Optional[int] = None, timeout: float = 1800.0) -> float:
    """Run `command` as ranks 0..world-1; return wall seconds from the first start to the last exit.

    `prefix(rank)` is put before the command (e.g. `ip netns exec HOST`). If any rank fails,
    the others are killed and RunFailed names the rank and its log. `threads` is each rank's
    OMP_NUM_THREADS (default: the cores divided by the ranks, as dptrain's launcher does).
    """
    ended = spawn_ranks(command, world, port=port, master_addr=master_addr, threads=threads, extra_env=extra_env,
                        prefix=prefix, log_dir=log_dir, timeout=timeout)
    if ended.failed_rank is not None:
        rank = ended.failed_rank
        raise RunFailed(f"rank {rank} {describe_exit(ended.failed_code)}; see {log_dir / f'rank{rank}.log'}")
    if ended.timed_out:
        raise RunFailed(f"the run took longer than {timeout:g} s; see the logs in {log_dir}")
    if ended.preempted:
        raise RunFailed(f"the ranks were stopped on request (exit code {ended.code}); see the logs in {log_dir}")
    return ended.seconds
