"""Fault points: named places where a test (or an operator rehearsing a failure) can kill this rank.

    DPTRAIN_FAULT=save-rename@1:2  DPTRAIN_FAULT_ONCE=/tmp/fired  dptrain train ... --max-restarts 1

kills rank 1 with SIGKILL at the point `save-rename` of its epoch-2 checkpoint, once: the file
named by DPTRAIN_FAULT_ONCE is created first, and a point whose marker exists does not fire
again (the restarted world runs through); DPTRAIN_FAULT_ACTION=freeze sends SIGSTOP instead of SIGKILL,
DPTRAIN_FAULT_ACTION=stop SIGUSR1 (a scheduler's warning to that rank alone). RANK may name several
ranks, train-middle@2,3:2, which each fault at that point (with DPTRAIN_FAULT_ONCE, each once: the
marker of rank 3 is FILE.rank3). Several faults are separated by ";": train-middle@3:2;regroup@1:2.
Without DPTRAIN_FAULT nothing here does anything.

RANK is always a rank of the job: the one the process started with (a joiner's, the one it took), the rank
`dptrain: worker rank N ...` and a membership change's `left` name. After a change of members (--min-workers)
the survivors are numbered again within their new group, but a fault still picks the process by its job rank:
after job rank 1 is lost, save-begin@2:3 is the process that was rank 2 at the start, not the one now rank 1.

Points: save-begin (before any file of the checkpoint), save-fsync (the data written, not yet
flushed to disk), save-rename (on disk under the temporary name), save-end (this rank's files
complete, before rank 0 prunes and before the other ranks have finished theirs); train-middle
(halfway through the steps of epoch EPOCH, counted from 1); regroup (live membership: this rank has said it
is alive and learned who is left after a failure in epoch EPOCH, and the new group is not built yet: a
second failure during the agreement); and step, where the number is not an
epoch but a training step (counted from 1 over the run): step@1:37 kills rank 1 right after its
37th optimizer step, which lands between checkpoints (--checkpoint-every-steps).
"""

from __future__ import annotations

import os
import re
import signal
from typing import Optional

POINTS = ("save-begin", "save-fsync", "save-rename", "save-end", "train-middle")  # a save's, and mid-epoch
LIVE_POINTS = ("regroup",)  # reached only with live membership (--min-workers) after a failure
STEP = "step"  # after a training step: its number is the step's, not an epoch's
SPEC = re.compile(r"^(?P<point>[a-z-]+)@(?P<ranks>\d+(?:,\d+)*):(?P<epoch>\d+)$")

_where: dict[str, Optional[int]] = {"rank": None, "epoch": None}


def at(rank: int, epoch: int) -> None:
    """Say which rank (of the job) and which checkpoint epoch the next fault points belong to."""
    _where.update(rank=rank, epoch=epoch)


def where() -> tuple[Optional[int], Optional[int]]:
    """The (rank, epoch) the next fault points belong to (what `at` said last)."""
    return _where["rank"], _where["epoch"]


def point(name: str) -> None:
    """Die here if DPTRAIN_FAULT names this point, rank and epoch (and it has not fired before)."""
    _fire(name, _where["rank"], _where["epoch"])


def step(rank: int, number: int) -> None:
    """Die here if DPTRAIN_FAULT is step@RANK:NUMBER for this rank's (of the job) step `number` (and it has not
    fired before)."""
    _fire(STEP, rank, number)


def _fire(name: str, rank: Optional[int], number: Optional[int]) -> None:
    specs = os.environ.get("DPTRAIN_FAULT")
    if not specs:
        return
    for spec in specs.split(";"):
        _fire_one(spec.strip(), name, rank, number)


def _fire_one(spec: str, name: str, rank: Optional[int], number: Optional[int]) -> None:
    match = SPEC.match(spec)
    if match is None or match["point"] not in (*POINTS, *LIVE_POINTS, STEP):
        raise ValueError(f"DPTRAIN_FAULT={spec!r} is not POINT@RANK:EPOCH (RANK: one rank or several, 2,3) with "
                         f"POINT one of {', '.join((*POINTS, *LIVE_POINTS))} (or {STEP}@RANK:STEP)")
    ranks = [int(listed) for listed in match["ranks"].split(",")]
    if (match["point"], int(match["epoch"])) != (name, number) or rank not in ranks:
        return
    marker = os.environ.get("DPTRAIN_FAULT_ONCE")
    if marker and len(ranks) > 1:  # each rank named fires once
        marker = f"{marker}.rank{rank}"
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    # DPTRAIN_FAULT_ACTION=freeze stops the process instead (SIGSTOP: alive, silent, holding its connections);
    # =stop sends it SIGUSR1, a scheduler's warning to this rank alone.
    action = os.environ.get("DPTRAIN_FAULT_ACTION")
    os.kill(os.getpid(), {"freeze": signal.SIGSTOP, "stop": signal.SIGUSR1}.get(action or "", signal.SIGKILL))
