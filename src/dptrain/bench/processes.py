"""Start the ranks of one benchmark run (any command: dptrain, a baseline script), each possibly in its own namespace.

dptrain's local launcher always runs `python -m dptrain` on 127.0.0.1; a benchmark also runs
baseline scripts and places ranks in emulated hosts, so it starts its processes here, with
the same torchrun-style environment (dptrain.runtime.launcher.worker_env), and keeps each
rank's output in a log file of the run directory.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from dptrain.errors import UserError
from dptrain.runtime.launcher import describe_exit, worker_env


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
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    procs: list[subprocess.Popen] = []
    logs = []
    begun = time.perf_counter()
    try:
        for rank in range(world):
            env = worker_env(rank, world, port, threads, {**os.environ, **(extra_env or {})},
                             master_addr=master_addr, tty=False)
            log = open(log_dir / f"rank{rank}.log", "wb")
            logs.append(log)
            full = (prefix(rank) if prefix else []) + list(command)
            procs.append(subprocess.Popen(full, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        deadline = begun + timeout
        pending = set(range(world))
        while pending:
            for rank in sorted(pending):
                code = procs[rank].poll()
                if code is None:
                    continue
                pending.discard(rank)
                if code != 0:
                    raise RunFailed(f"rank {rank} {describe_exit(code)}; see {log_dir / f'rank{rank}.log'}")
            if time.perf_counter() > deadline:
                raise RunFailed(f"the run took longer than {timeout:g} s; see the logs in {log_dir}")
            time.sleep(0.05)
        return time.perf_counter() - begun
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for log in logs:
            log.close()
