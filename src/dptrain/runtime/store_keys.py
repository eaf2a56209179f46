"""Every key dptrain's processes write in a run's store, in one place: what each means, who writes it.

Pure Python (no torch), so that the launcher, which serves the store, reads them without importing
torch. Values are signed with the run's secret where another process decides on them
(dptrain.runtime.signed); docs/reference/security.md says which.
"""

from __future__ import annotations

HEARTBEAT = "dptrain/heartbeat/"  # + rank: that rank's beat counter (dptrain.runtime.heartbeat)
REPORTED = "dptrain/error"  # "RANK CODE" of the first rank that ended with an error it said itself
REPORTED_SEEN = "dptrain/error/seen"  # how many peers read it (the store's host waits for them before it exits)

MEMBERSHIP = "dptrain/membership/"  # live membership (dptrain.runtime.membership)
FAILED = MEMBERSHIP + "failed/"  # + generation: a member left that group after a failure (its rank)
REFUSED = MEMBERSHIP + "refused/"  # + job rank: it sent what is not JSON; no agreement keeps or admits it
REPLACING = MEMBERSHIP + "replacing"  # set by a store service that starts new workers for lost ranks (--replace)
LOST = MEMBERSHIP + "lost"  # how many ranks agreements left out so far; LOST/N (from 1): the Nth one's rank
EXITED = MEMBERSHIP + "exited/"  # + rank: the launcher serving the store saw that rank's process end
WORLD = MEMBERSHIP + "world"  # the job's first world size (set by the launcher that serves the store)
JOINERS = MEMBERSHIP + "joiners"  # how many ranks were taken by joiners
FINISHED = MEMBERSHIP + "finished"  # set by rank 0 when the run is over: a joiner still waiting goes home
# async (dptrain.strategies.asynchronous): + "RANK/EPOCH", that worker's numbers of that epoch (JSON);
# + "GROUP/GENERATION", "MEMBERS;EPOCH;LEFT" of the service's live members
ASYNC_EPOCHS = MEMBERSHIP + "async-epochs/"
ASYNC_MEMBERS = MEMBERSHIP + "async/"


def generation(number: int) -> str:
    """The keys of agreement `number` on who is left: + "alive/RANK", "decider", "members" (membership._agree)."""
    return f"{MEMBERSHIP}{number}/"


def joined(rank: int) -> str:
    """A joiner is ready ("ready"): the next epoch end may admit it."""
    return f"{MEMBERSHIP}join/{rank}"


def admitted(rank: int) -> str:
    """Rank 0 admitted joiner `rank`: "GENERATION;RANKS;EPOCH"."""
    return f"{MEMBERSHIP}admit/{rank}"
