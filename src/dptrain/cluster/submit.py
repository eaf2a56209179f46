"""Submitting a written job script and following it to the end: the thin, impure step after rendering."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from dptrain.errors import UserError

POLL_SECONDS = 2.0  # between two looks at the job's state


@dataclass(frozen=True)
class JobStatus:
    """A scheduler's word on a job: its state, whether that is final, and the script's exit code."""

    state: str
    finished: bool
    exit_code: int = 0
    requeued_as: Optional[str] = None  # (from follow) the job this one ended as, having requeued itself as it
    restarts: int = 0  # how often the scheduler has put this job back in the queue (SLURM's Restarts)


def run_tool(argv: Sequence[str], *, what: str, timeout: float = 60, cwd: Optional[Path] = None) -> str:
    """Run a scheduler command (sbatch, qsub, scontrol, qstat); its stdout, or one line saying why it failed."""
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                                stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise UserError(f"{argv[0]} is not on the PATH; {what} needs it (run on the cluster's login node)") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{argv[0]} did not answer within {timeout:g} s while trying to {what}") from None
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip().splitlines()
        raise UserError(f"{' '.join(argv[:2])} failed to {what}: {message[-1] if message else f'exit {result.returncode}'}")
    return result.stdout


class OutputFollower:
    """Copies what a job appends to its output file to our stdout, as `tail -f` would."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def pump(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
        if chunk:
            self.offset += len(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()


def follow(scheduler, job_id: str, output: Path, *, timeout: Optional[float]) -> JobStatus:
    """Poll `scheduler.poll(job_id)` until the job is finished (or `timeout` seconds pass), echoing its output;
    a job that requeued itself as another (PBS) is followed into that one."""
    deadline = None if timeout is None else time.monotonic() + timeout
    first = job_id
    follower = OutputFollower(output)
    last_state, last_restarts = None, 0
    while True:
        status = scheduler.poll(job_id)
        follower.pump()
        queued_again = last_state == "RUNNING" and status.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD")
        if queued_again or status.restarts > last_restarts:
            # (a requeue that started again within one poll is seen only in the count of restarts)
            print(f"dptrain: job {job_id} went back to the queue "
                  f"({status.state if queued_again else f'restart {status.restarts}, {status.state} again'}); "
                  "following it until it finishes", flush=True)
        last_state, last_restarts = status.state, max(last_restarts, status.restarts)
        if status.finished:
            time.sleep(0.5)  # the last lines may reach the shared file system just after the state
            follower.pump()
            # (a scheduler whose jobs requeue themselves as a new job, PBS, says which)
            successor = scheduler.requeued_as(output.parent, job_id) if hasattr(scheduler, "requeued_as") else None
            if successor is None:
                return status if job_id == first else replace(status, requeued_as=job_id)
            print(f"dptrain: job {job_id} was requeued as job {successor}; following it until it finishes", flush=True)
            job_id, last_state, last_restarts = successor, None, 0
            continue
        if deadline is not None and time.monotonic() > deadline:
            raise UserError(f"job {job_id} is still {status.state} after --wait-timeout {timeout:g} s; "
                            f"it keeps running, its output goes to {output}")
        time.sleep(POLL_SECONDS)
