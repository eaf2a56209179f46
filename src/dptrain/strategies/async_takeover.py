"""async's workers when one of them is lost: the membership generations they hear of, and the take-over from a
lost rank 0, which holds the global model and the merge service (dptrain.strategies.merge_service).

Async calls these: a worker looks whether rank 0 is gone (RankZeroWatch) where the workers can go on without it
(can_take_over), and once it is, the workers left regroup (regroup_without_rank_0), agree on the newest global
model any of them had (newest_global) and the lowest serves it. What this keeps and loses: docs/how-to/async.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from dptrain.runtime.distributed import DistContext, PeerFailure, store_served
from dptrain.runtime import signed
from dptrain.runtime.membership import STALL, Evicted, Membership, gone, regroup
from dptrain.runtime.store_keys import generation as generation_keys
from dptrain.strategies.merge_service import LOST_POLL, SERVICE_GROUP_TIMEOUT, MergeService, members_key, taken_over


def takeover_generation(group) -> int:
    """The generation of the group the workers of `group` make when they take over from its rank 0: past every
    generation its merge service can name (one per worker lost, fewer than its world size)."""
    return group.generation + group.world_size


def takeover_key(group) -> str:
    """The store key the workers of `group` set when they begin to take over from its rank 0 (the agreement's
    decider key of `takeover_generation`): its rank 0 stops once it is there, the others join in."""
    return generation_keys(takeover_generation(group)) + "decider"


class ServiceLost(PeerFailure):
    """The merge service's host (rank 0) is gone: the workers left take over (`Async._take_over`)."""


def can_take_over(live: bool, group) -> bool:
    """Whether the workers left can go on when rank 0 is lost: live membership, over a store rank 0 does not
    host (dptrain's launcher, or `dptrain serve-store`, serves it)."""
    return live and store_served() and group.store is not None


def stop_if_taken_over(service: Optional[MergeService], ctx: DistContext) -> None:
    """Rank 0: Evicted once the other workers took over from it (it was frozen, or judged so)."""
    if service is not None and service.taken_over:
        raise Evicted(taken_over(ctx.group.members[0]))


def membership_of(ctx: DistContext, generation: int) -> Membership:
    """What membership generation `generation` of the merge service of ctx's group says, from the store."""
    record = signed.wait_for(ctx.group.store, members_key(ctx.group.generation, generation), ctx.timeout)
    if record is None:  # the service announces a generation only once the store holds it, signed
        raise PeerFailure(f"rank {ctx.rank}: the merge service named membership generation {generation}, "
                          "but the run's store holds none signed with the run's secret")
    members, epoch, left = record.split(";")
    return Membership(ctx.group.generation + generation, tuple(int(r) for r in members.split(",")),
                      int(epoch), tuple(int(r) for r in left.split(",")))


class RankZeroWatch:
    """A worker's looks at whether rank 0, which holds the global model and the merge service, is gone."""

    def __init__(self) -> None:
        self.looked = 0.0  # when this worker last looked (`look`)

    def look(self, ctx: DistContext, *, now: bool = False, until: Optional[float] = None) -> None:
        """ServiceLost if rank 0 is judged gone (the launcher saw its process end, or its heartbeat stopped for
        STALL seconds) or another worker began to take over. Looks at most every LOST_POLL seconds, unless
        `now`; with `until`, keeps looking until then (heartbeats are judged across looks)."""
        group = ctx.group
        store, host = group.store, group.members[0]
        begun = takeover_key(group)
        while True:
            moment = time.monotonic()
            if now or until is not None or moment - self.looked >= LOST_POLL:
                self.looked = moment
                why = gone(store, ctx.heartbeat, [host], STALL).get(host)
                if why is None and signed.present(store, begun):
                    why = "another worker found it gone"
                if why is not None:
                    raise ServiceLost(f"rank {host}, which holds the global model and the merge service, is gone "
                                      f"({why})")
            if until is None or moment >= until:
                return
            time.sleep(LOST_POLL)


@dataclass(frozen=True)
class TakenOver:
    """What the workers left agree on when they take over (`newest_global`)."""

    state: torch.Tensor  # the newest global model any of them was given
    version: int  # its version
    holder: int  # the rank (of the new group) that had it
    epoch: int  # the epoch (from 0) they share the data from: the first after every one's present one
    stop: bool  # whether any of them had heard of a stop
    epochs: dict[int, int]  # the epoch each is in or starts next, by its rank of the new group
    membership: Membership  # the workers left, from `epoch` on
    comm_bytes: int  # what the broadcast of the newest global model cost this worker


def regroup_without_rank_0(ctx: DistContext, service_group, epoch: int, min_workers: int):
    """Rank 0 is lost: the workers left regroup through the store (each arrives at its next exchange with the
    service or its next look, within a step or two, from `epoch`, where it is); `ctx` takes the new group.
    Returns the new group's merge service group (`service_group`, the old one, is abandoned)."""
    old = ctx.group
    if service_group is not None:  # (not closed: a message to the lost rank may still wait in it)
        service_group.abandon()
    group, _ = regroup(old, takeover_generation(old), epoch, min_workers=min_workers, timeout=ctx.timeout)
    ctx.rank, ctx.world_size, ctx.group = group.rank, group.world_size, group
    return group.subgroup(range(group.world_size), backend="gloo", timeout=SERVICE_GROUP_TIMEOUT.total_seconds(),
                          name="the merge service")


def newest_global(group, service_group, base: torch.Tensor, mine: tuple[int, int, bool],
                  first: tuple[int, ...]) -> TakenOver:
    """After `regroup_without_rank_0`, every worker of `group`: the newest global model any of them was given (the
    highest version: it holds every merge a worker left was answered; what the lost rank merged last, unseen by
    any, and a merge whose answer was lost with rank 0, which its worker sends again, are not in it), from
    `mine` (this worker's base version, its epoch and whether it heard of a stop) and `base`, its global model;
    `first`: the ranks of the job the run started with."""
    told = group.gather_objects("take-over", mine)
    versions = [version for version, _, _ in told]
    holder = versions.index(max(versions))
    state = base.clone()
    sent = service_group.broadcast(state, holder) if group.world_size > 1 else 0
    epoch = max(epoch for _, epoch, _ in told) + 1  # every worker left is sure to start it after this
    membership = Membership(group.generation, tuple(group.members), epoch,
                            tuple(rank for rank in first if rank not in group.members))
    return TakenOver(state, max(versions), holder, epoch, any(stopping for _, _, stopping in told),
                     {rank: epoch for rank, (_, epoch, _) in enumerate(told)}, membership, sent)


def took_over(why: str, me: int, seconds: float, group, taken: TakenOver, merge: str) -> str:
    """The line the new rank 0 (rank `me` of the job) prints once it serves."""
    momentum = "; its server momentum starts again from zero" if merge == "delayed-nesterov" else ""
    plural = "s" if group.world_size > 1 else ""
    return (f"dptrain: {why}: rank {me} took over in {seconds:.1f} s, with {group.world_size} worker{plural} "
            f"(rank{plural} {', '.join(map(str, group.members))} of the job), from the newest global model any of "
            f"them had (version {taken.version}, from rank {group.members[taken.holder]}){momentum}; they share the "
            f"data from epoch {taken.epoch + 1}")
