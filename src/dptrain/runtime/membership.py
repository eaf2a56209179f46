"""Live membership: after a worker fails or freezes, the survivors agree on who is left and go on together.

A rank that meets a PeerFailure (a collective failed or timed out) calls `regroup`:

1. it leaves the failed group at once (`Group.abandon`), saying so in the store, so that every peer
   still waiting in a collective of that group gives up within moments instead of after --timeout
   (a watched collective also gives up on a member whose heartbeat stopped: a frozen rank);
2. it says it is alive in the rendezvous store for the next generation (key `alive/RANK`), with
   the epoch it failed in and the step of it it can go on from (0, its start; allreduce's latest
   commit with --commit-every-steps), and
3. the first member to get there (a compare-and-set in the store) decides the new members: every
   old member that said it is alive, none whose heartbeat stopped for `stall` seconds (dead or
   frozen; at once for one whose process the launcher saw end), waiting at most `timeout` seconds for the
   others; it writes the members and the epoch to continue from;
4. every member builds a fresh process group of the members (`Group.over_store`, generation N), watching
   the others meanwhile: a member lost after it answered (its process ended, or its heartbeat stopped)
   would hold the build for --timeout, so the others give that group up and agree again (generation
   N+1, among the members of N); a rank left out (evicted while frozen) gets Evicted.

The (epoch, step) to continue from is the earliest any survivor is ready to redo: a rank may have passed
the epoch's last collective (or a step's all-reduce) while another failed inside it (the dead rank
contributed, then died), so each rank keeps its state from its latest start or commit and the one before.

Under dptrain's launcher with --min-workers the launcher serves the store (dptrain.runtime.spawn,
STORE_SERVED), so any rank may be lost, rank 0 included: the lowest rank left becomes rank 0 of the
new group and writes the results from then on. Where rank 0 hosts the store, losing it ends the run.

No majority vote is needed against split brain: each generation has one decider (the store's
compare-and-set) and one list of members, so two parts of the job can never both go on as the run; a
rank that cannot reach the store cannot answer and is left out. The price is the store's host, which
must stay up (dptrain's launcher, or `dptrain serve-store` on a job's batch host; torchft's lighthouse
is the same single point). Each rank the agreements leave out is recorded (`LOST`, `lost_since`) for a
store service that starts new workers in their place (`dptrain serve-store --replace N`, SLURM and PBS).

Joining (a replacement the launcher starts for a lost worker, --replace-workers, or `dptrain join RUN_DIR`):

1. the joiner takes the next rank of the job (`take_rank`: the job's first WORLD ranks, then one more per
   joiner), prepares everything that needs no other worker (imports, data, model) and says it is ready
   (`announce`, key `join/RANK`), beating its heartbeat from then on;
2. at the next epoch end the members' rank 0 reads the joiners ready (`ready_joiners`) while there is room
   (fewer live workers than --max-workers, by default than the job started with) and tells the others
   in the epoch end's stop check;
3. every member and joiner builds the group of members + joiners (generation N); rank 0 tells each joiner
   its admission first (`admit/RANK`: "GENERATION;RANKS;EPOCH"), which the joiner waits for (`admission`);
4. rank 0 hands its whole state (model, optimizer, schedule, strategy state, epoch, step, history) to the
   new group in one broadcast (the trainer's heal), and every worker trains on from the next epoch.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional

from dptrain import faults
from dptrain.errors import GroupLost
from dptrain.runtime.group import REFUSED, Evicted, Group, PeerFailure, first_line  # noqa: F401 - Evicted, for callers
from dptrain.runtime import signed
from dptrain.runtime.heartbeat import bounded

from dptrain.runtime.store_keys import (  # noqa: E402, F401 - the keys, for callers too
    EXITED, FINISHED, JOINERS, LOST, MEMBERSHIP as PREFIX, REPLACING, WORLD, admitted, joined)
from dptrain.runtime.store_keys import generation as generation_keys  # noqa: E402
STALL = 3.0  # seconds without a heartbeat after which a member that did not answer is left out


@dataclass(frozen=True)
class Membership:
    generation: int
    members: tuple[int, ...]  # ranks of the job, in their order in the new group
    epoch: int  # the epoch (from 0) every member continues from
    left: tuple[int, ...]  # the old members that are gone
    joined: tuple[int, ...] = ()  # ranks of the job that joined (replacements, `dptrain join`)
    healed_bytes: int = 0  # the state rank 0 handed the joiners
    step: int = 0  # the steps of `epoch` done before the members continue (allreduce's commits; 0: its start)
    rows_lost: int = 0  # of the rows of `epoch` read before `step`, those the lost members read (trained all the same)


def regroup(group: Group, generation: int, epoch: int, *, min_workers: int, timeout: float,
            stall: float = STALL, step: int = 0, unit: int = 1) -> tuple[Group, Membership]:
    """Leave the failed `group` and make generation `generation` of the survivors (see the module's
    docstring): (the new group, the membership). `epoch` is the epoch this rank failed in (it can also
    redo the one before); `step`, the steps of it done at this rank's last commit (allreduce's
    --commit-every-steps: it can also go back to the commit before): the survivors continue from the
    earliest (epoch, step) any of them holds. `unit`: the ranks of `group` go on in blocks of that many
    (replica groups of a sharded model, --shard hybrid): a block that lost a rank is left out whole (its
    shards have no second copy), its other ranks leave (GroupLost), and `min_workers` counts blocks."""
    store, me, first = group.store, group.members[group.rank], list(group.members)
    if store is None:
        raise PeerFailure(f"rank {me}: no rendezvous store to agree on new members with")
    group.abandon()
    group.close()
    old = first
    while True:
        members, (resume, at) = _agree(group, store, me, old, generation, (epoch, step), timeout, stall, unit)
        membership = Membership(generation, members, resume, tuple(r for r in first if r not in members), step=at)
        if unit > 1 and len(members) // unit < min_workers:
            groups = len(members) // unit
            raise PeerFailure(f"rank {me}: only {groups} replica group{'s' if groups != 1 else ''} of {unit} ranks "
                              f"left (ranks {', '.join(map(str, members)) or 'none'}), fewer than --min-workers "
                              f"{min_workers} (counted in replica groups with --shard hybrid); lost "
                              f"rank{'s' if len(membership.left) > 1 else ''} {', '.join(map(str, membership.left))}")
        if len(members) < min_workers:
            raise PeerFailure(f"rank {me}: only {len(members)} worker{'s' if len(members) > 1 else ''} left "
                              f"(ranks {', '.join(map(str, members))}), fewer than --min-workers {min_workers}; "
                              f"lost rank{'s' if len(membership.left) > 1 else ''} "
                              f"{', '.join(map(str, membership.left))}")
        faults.point("regroup")
        new = _build(group, store, me, members, generation, stall)
        if new is not None:
            return new, membership
        # a member was lost after it answered: agree again among those of this generation
        old, generation = list(members), generation + 1


def _agree(group: Group, store, me: int, old: list[int], generation: int, at: tuple[int, int], timeout: float,
           stall: float, unit: int = 1) -> tuple[tuple[int, ...], tuple[int, int]]:
    """Say this rank is alive for `generation` at `at` (epoch, step) and learn the members the decider chose and
    the (epoch, step) to go on from (Evicted when this rank is not among them; GroupLost when its block of
    `unit` ranks lost another one)."""
    key = generation_keys(generation)
    signed.put(store, f"{key}alive/{me}", f"{at[0]} {at[1]}")
    # The first survivor here decides; the store's compare-and-set makes it one rank for all (signed values:
    # a process without the run's secret can neither decide nor name the members).
    decider = int(signed.claim(store, f"{key}decider", str(me)))
    if decider == me:
        decided = _decide(group, store, key, old, timeout, stall, unit)
        signed.put(store, f"{key}members", decided)
    else:
        wait = timeout + stall + 10
        try:
            decided, why = signed.wait_for(store, f"{key}members", wait), f"within {wait:g} s"
        except Exception as exc:  # noqa: BLE001 - the store's host is gone or frozen
            decided, why = None, f"({type(exc).__name__})"
        if decided is None:
            raise PeerFailure(f"rank {me}: rank {decider}, which was to say who is left after a worker failed, "
                              f"did not {why}")
    names, resume, step = decided.split(";")
    members = tuple(int(rank) for rank in names.split(","))
    if decider == me:  # what a store service replacing lost ranks reads (`lost_since`)
        for rank in (rank for rank in old if rank not in members):
            index = int(bounded(lambda: store.add(LOST, 1)))
            signed.put(store, f"{LOST}/{index}", str(rank))
    if me not in members and unit > 1:
        _leave_lost_block(store, key, me, old, members, unit)
    if me not in members:
        raise Evicted(f"rank {me}: the other workers went on without this one (generation {generation}: "
                      f"ranks {', '.join(map(str, members))}); it did not answer while they agreed who is left "
                      f"(frozen or too slow)")
    return members, (int(resume), int(step))


def _build(group: Group, store, me: int, members: tuple[int, ...], generation: int, stall: float) -> Optional[Group]:
    """Generation `generation` of `members` (`Group.over_store`), or None when one of them is lost while it is
    built (its process ended, or its heartbeat stopped for `stall` seconds): building a gloo group waits for
    every member, for the run's whole --timeout, and a member that answered and then died would hold the
    others that long. The abandoned build ends on its own at that timeout, in its thread."""
    built: dict = {}
    # Its own connection to the store: building waits in the store for every member's address, and a store
    # client waits for one call at a time (this thread's checks and the heartbeat would wait behind it).
    own = store.clone() if hasattr(store, "clone") else store

    def build() -> None:
        try:
            built["group"] = Group.over_store(own, me, members, generation, device=group.device,
                                              backend=group.backend, timeout=group.timeout,
                                              heartbeat=group.heartbeat)
        except Exception as exc:  # noqa: BLE001 - reported by the waiting thread
            built["error"] = exc

    thread = threading.Thread(target=build, name=f"dptrain-build-generation-{generation}", daemon=True)
    thread.start()
    others = [rank for rank in members if rank != me]
    while thread.is_alive():
        thread.join(timeout=0.1)
        if not thread.is_alive():
            break
        if gone(store, group.heartbeat, others, stall):
            return None
    if "error" in built:
        raise PeerFailure(f"rank {me}: building the group of ranks {', '.join(map(str, members))} failed: "
                          f"{first_line(built['error'])}")
    new = built["group"]
    new.watch = group.watch
    return new


def gone(store, heartbeat, ranks, stall: float, *, in_store=lambda rank: rank) -> dict[int, str]:
    """Which of `ranks` are gone, each with why: the launcher serving the store saw its process end (at
    once, not after `stall` seconds of silence), or its heartbeat has not moved for `stall` seconds (frozen
    or gone; `heartbeat.stalled` tracks counters across calls, so poll it). `in_store(rank)` is the rank
    the launcher's exit note and the heartbeat name (the job's rank, where `ranks` are ranks of a group of
    some of them)."""
    lost = {rank: "its process ended" for rank in ranks
            if store is not None and signed.present(store, f"{EXITED}{in_store(rank)}")}
    lost.update({rank: "it sent what is not JSON" for rank in ranks
                 if store is not None and rank not in lost and refused(store, in_store(rank))})
    if heartbeat is not None and ranks:
        of_job = {in_store(rank): rank for rank in ranks}
        for quiet in heartbeat.stalled(list(of_job), stall):
            lost.setdefault(of_job[quiet], f"its heartbeat stopped for {stall:g} s (frozen or gone)")
    return lost


def _leave_lost_block(store, key: str, me: int, old: list[int], members: tuple[int, ...], unit: int) -> None:
    """A rank whose block of `unit` ranks (its replica group) lost a rank that did not answer: GroupLost, naming
    it. (Every rank of its block answered: this one was too late, and is Evicted as any rank would be.)"""
    place = old.index(me) // unit
    block = old[place * unit:(place + 1) * unit]
    lost = [rank for rank in block if rank != me and signed.read(store, f"{key}alive/{rank}") is None]
    if not lost:
        return
    groups = len(members) // unit
    raise GroupLost(f"rank {me}: its replica group lost rank{'s' if len(lost) > 1 else ''} "
                    f"{', '.join(map(str, lost))}, which held the other shards of its model (no second copy is kept); "
                    f"it leaves the run, and the other {groups} replica group{'s' if groups != 1 else ''} go on "
                    f"(ranks {', '.join(map(str, members)) or 'none'} of the job)")


def _decide(group: Group, store, key: str, old: list[int], timeout: float, stall: float, unit: int = 1) -> str:
    """The decider: "RANKS;EPOCH;STEP" once every old member has answered or gone quiet (or `timeout` passed):
    the earliest (epoch, step) any of them said. With `unit`, only whole blocks of that many ranks of `old`
    (replica groups) are members."""
    deadline = time.monotonic() + timeout
    heartbeat = group.heartbeat
    while True:
        said = {rank: signed.read(store, f"{key}alive/{rank}") for rank in old}
        answered = {rank: tuple(int(v) for v in value.split()) for rank, value in said.items()
                    if value is not None and not refused(store, rank)}
        waiting = [rank for rank in old if rank not in answered]
        quiet = gone(store, heartbeat, waiting, stall)
        if all(rank in quiet for rank in waiting) or time.monotonic() >= deadline:
            blocks = [old[first:first + unit] for first in range(0, len(old), unit)]
            members = sorted(rank for block in blocks if all(rank in answered for rank in block) for rank in block)
            epoch, step = min(answered.values())
            return f"{','.join(map(str, members))};{epoch};{step}"
        time.sleep(0.1)


def refused(store, rank: int) -> bool:
    """Whether a member refused what job rank `rank` sent (not JSON): it is in no generation from then on."""
    return signed.present(store, f"{REFUSED}{rank}")


def lost_since(store, seen: int) -> tuple[int, list[int]]:
    """The ranks agreements left out after the first `seen` ones (`dptrain serve-store --replace` starts a
    worker for each): (how many so far, those ranks)."""
    count = int(bounded(lambda: store.add(LOST, 0)))
    said = [signed.read(store, f"{LOST}/{index}") for index in range(seen + 1, count + 1)]
    return count, [int(rank) for rank in said if rank is not None]  # a counter bumped by a forger names nobody


def note(membership: Optional[Membership]) -> Optional[dict]:
    """What metrics.jsonl records about a membership change."""
    if membership is None:
        return None
    record = {"generation": membership.generation, "members": list(membership.members),
              "left": list(membership.left), "continued_from_epoch": membership.epoch + 1}
    if membership.step:  # allreduce's commits: the rest of that epoch's rows, shared over the members
        record.update(continued_from_step=membership.step, rows_read_by_the_lost=membership.rows_lost)
    if membership.joined:
        record.update(joined=list(membership.joined), healed_bytes=membership.healed_bytes)
    return record


# -- joining ---------------------------------------------------------------------------------------
JOIN_POLL = 0.5  # seconds between a waiting joiner's looks at the store


def take_rank(store) -> int:
    """A new rank of the job for a joiner: the job's first ranks are 0..WORLD-1, joiners' come after."""
    return _world(store) + int(bounded(lambda: store.add(JOINERS, 1))) - 1


def _world(store) -> int:
    world = signed.read(store, WORLD)
    if world is None:
        raise PeerFailure(f"the run's store holds no world size signed with the run's secret ({WORLD}): this worker "
                          "cannot take a rank of it (is it the store of a run of yours?)")
    return int(world)


def announce(store, rank: int) -> None:
    """A joiner is ready (data and model made, heartbeat beating): the next epoch end may admit it."""
    signed.put(store, joined(rank), "ready")  # a joiner without the run's secret is never admitted


def ready_joiners(store, room: int) -> tuple[int, ...]:
    """Rank 0 at an epoch end: up to `room` joiners ready and not admitted yet, lowest rank first."""
    if room <= 0 or not signed.present(store, WORLD):
        return ()
    world = _world(store)
    taken = int(bounded(lambda: store.add(JOINERS, 0)))
    ready = []
    for rank in range(world, world + taken):
        if len(ready) == room:
            break
        if signed.present(store, joined(rank)) and not signed.present(store, admitted(rank)) \
                and not refused(store, rank):
            ready.append(rank)
    return tuple(ready)


def admit(store, joiners, generation: int, members, epoch: int) -> None:
    """Rank 0: tell each joiner it is in generation `generation` of `members`, from `epoch` (from 0) on."""
    decided = f"{generation};{','.join(map(str, members))};{epoch}"
    for rank in joiners:
        signed.put(store, admitted(rank), decided)


def admission(store, rank: int) -> Optional[tuple[int, tuple[int, ...], int]]:
    """A joiner: wait until the run admits it: (generation, members, epoch to start from), or None when the run
    ended first. No deadline while the store answers (a spare waits for a place); a store that stops
    answering raises (StoreUnanswered, or the store's error: the run's launcher is gone)."""
    key = admitted(rank)
    while (decided := signed.read(store, key)) is None:
        if signed.present(store, FINISHED):
            return None
        time.sleep(JOIN_POLL)
    generation, members, epoch = decided.split(";")
    return int(generation), tuple(int(r) for r in members.split(",")), int(epoch)


def finished(store) -> None:
    """Rank 0 at the end of the run: joiners still waiting are not going to be admitted."""
    if store is not None:
        try:
            signed.put(store, FINISHED, "1")
        except Exception:  # noqa: BLE001 - the store's host is gone: so are the joiners' hopes, and their store
            pass
