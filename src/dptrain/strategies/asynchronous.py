"""async: workers never wait for each other; each merges its progress into a global model.

When a worker finishes an epoch (every `every` epochs) it sends `delta = local - base` (base: the global model
it last received) to a merge service beside rank 0, which applies `global += delta / W` and answers with the
new global; the worker continues from it at once. If every worker merges once, in any order, the global model
is the plain average of the workers' models, as under `sync`. `merge="ema"` applies `global = (global + local)
/ 2` instead (kept for comparison); `merge="delayed-nesterov"` adds server momentum once per round of W merges
(Liu et al. 2024, arXiv:2401.09135). `compression` encodes the deltas, with error feedback.

A rank asked to stop tells the service, whose replies carry the stop to the others; each checkpoints at its
own epoch end, and rank 0 concludes the run for every rank that is done. With live membership (`live`, the
trainer's min_workers) the service leaves a lost worker out and merges over the workers left; where the store
is served apart from rank 0, a lost rank 0 is taken over by the lowest of them, from the newest global model
any of them had.

The global model and the merge service, with its messages: dptrain.strategies.merge_service; the take-over:
dptrain.strategies.async_takeover. The rules in full (each merge, stopping, live membership, the take-over):
docs/how-to/async.md, "How it works".
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, replace
from datetime import timedelta
from typing import Optional

import torch
from torch import nn

from dptrain.data.sampler import EpochPlan, shard_plan
from dptrain.errors import Preempted
from dptrain.runtime.distributed import DistContext, PeerFailure
from dptrain.runtime.group import first_line
from dptrain.runtime.membership import STALL, Evicted, Membership
from dptrain.strategies.async_records import Share, TrainedShares
from dptrain.strategies.async_takeover import (RankZeroWatch, ServiceLost, can_take_over, membership_of,
                                               newest_global, regroup_without_rank_0, stop_if_taken_over,
                                               takeover_key, took_over)
from dptrain.strategies.base import Meeting, Strategy
from dptrain.strategies.collectives import broadcast_module
from dptrain.strategies.compression import COMPRESSIONS, ErrorFeedback, decode
from dptrain.strategies.merge_service import (
    DELTA_MERGES, DONE, FINISH, HEADER_SIZE, LIVE_HEADER_SIZE, LOST_POLL, MERGE, MERGES, REFRESH,
    STOP, TAG_GLOBAL, TAG_PAYLOAD, TAG_REPLY, TAG_REQUEST, VERSION, GlobalModel,
    MergeService, flat_state, load_flat_state, members_key)  # (members_key: for those who import it from here)
from dptrain.strategies.rules.asynchronous import AsyncRules
from dptrain.strategies.async_places import ServicePlaces
from dptrain.strategies.rules.sharding import averaging_refused
from dptrain.strategies.sharded import Shardable


class Async(ServicePlaces, Shardable, AsyncRules, Strategy):
    """Barrier-free merging into a global model at epoch ends (every `every` epochs).

    With a sharded model (`shard_as`, --shard hybrid), the global model is sharded as the replicas are: one merge
    service per place j of a replica group, on group 0's rank j, holds shard j of the global model, and rank j of
    every group merges its shards into it (docs/how-to/sharding.md, "async across replica groups")."""

    name = "async"
    # Never all at once: other ranks may still merge after rank 0's last epoch (finish() has a newer global
    # model), and live membership hears of a loss in the merges (`live_change`).
    meeting = Meeting("merges", averages_checked=True)

    def __init__(self, every: int = 1, merge: str = "delta", max_staleness: Optional[int] = None,
                 server_momentum: float = 0.9, server_lr: float = 1.0, compression: str = "none") -> None:
        super().__init__()
        if every < 1:
            raise ValueError("every must be at least 1")
        if merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, not {merge!r}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError("max_staleness must be at least 0")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
        if compression != "none" and merge not in DELTA_MERGES:
            raise ValueError(f"compression {compression} needs a merge of deltas ({' or '.join(DELTA_MERGES)}); "
                             f"merge {merge} sends whole models")
        if not 0 <= server_momentum < 1:
            raise ValueError(f"server_momentum must be at least 0 and less than 1, not {server_momentum}")
        if server_lr <= 0:
            raise ValueError(f"server_lr must be greater than 0, not {server_lr}")
        self.every, self.merge, self.max_staleness = every, merge, max_staleness
        self.server_momentum, self.server_lr, self.compression = server_momentum, server_lr, compression
        self.feedback = ErrorFeedback(compression)  # this worker's residual (error feedback)
        self.base: Optional[torch.Tensor] = None
        self.base_version = 0
        self.merges = 0
        self.refreshes = 0
        self.max_staleness_seen = 0
        self.global_model: Optional[GlobalModel] = None
        self.service: Optional[MergeService] = None
        self.group = None
        self._diverged = False
        self._stop_seen = False  # a reply said that some rank was asked to stop
        self._final: Optional[dict] = None
        # Live membership (`live`, the trainer's min_workers): the epoch this worker is in or starts next, the last
        # generation it heard of, what that generation says (Membership: members, the epoch they share the data
        # from, the ranks lost) and the one the trainer took (`live_change`).
        self._epoch = 0
        self._generation = 0
        self._heard: Optional[Membership] = None
        self._taken: Optional[Membership] = None
        self._first: tuple[int, ...] = ()  # the ranks of the job the run started with
        self.shares = TrainedShares()  # the plans of the epochs, and which worker's share of each was merged
        self._merges_recorded = 0  # this worker's merges when it last recorded an epoch
        self._began = False
        self._watch = RankZeroWatch()  # this worker's looks at whether the service's host is gone

    @classmethod
    def from_config(cls, config) -> "Async":
        return cls(every=config.sync_every, merge=config.merge, max_staleness=config.max_staleness,
                   server_momentum=config.server_momentum, server_lr=config.server_lr, compression=config.compression)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        super().setup(model, optimizer, ctx)
        if self.shard_options is not None:
            model = self._shard_setup_global(model, optimizer, ctx)
        elif ctx.world_size > 1:
            self.comm_bytes += broadcast_module(model, group=self.ctx.group)
        if self._merging > 1:
            self.group = self._service_group(ctx)
        self.base = flat_state(model)  # (sharded: this rank's shards)
        self._first = tuple(ctx.group.members)
        if self._index == 0:
            self._serve(GlobalModel(self.base, self._merging, self.merge, self.server_momentum, self.server_lr))
        return model

    def _serve(self, model: GlobalModel, epochs: Optional[dict[int, int]] = None) -> None:
        """Rank 0: hold the global model and, with other workers, the merge service (`epochs`: where each worker
        is, after a take-over)."""
        self.global_model = model
        if self._merging > 1:
            takeover = takeover_key(self.ctx.group) if can_take_over(self.live, self.ctx.group) else None
            self.service = MergeService(model, self.group, self.ctx, self.compression, self.every, self.live,
                                        takeover, ranks=self.group.members)
            self.service.epochs.update(epochs or {})
            self.service.start()

    # -- talking to the service ----------------------------------------------------------------
    def _request(self, kind: int, payload: Optional[torch.Tensor] = None,
                 stopping: bool = False) -> tuple[Optional[torch.Tensor], int, int]:
        """One exchange with the service: returns (global state or None, version, staleness);
        for DONE, (None, the outcome rank 0 concluded, 0). When the service's host is lost on the way, the
        workers left take over (`_take_over`) and this worker asks the new service again; if it hosts it now,
        a DONE returns (None, 0, 0): the caller concludes as rank 0."""
        while True:
            try:
                return self._request_once(kind, payload, stopping)
            except ServiceLost as lost:
                self._take_over(str(lost))
            if kind == DONE and self._index == 0:
                return None, 0, 0

    def _request_once(self, kind: int, payload: Optional[torch.Tensor],
                      stopping: bool) -> tuple[Optional[torch.Tensor], int, int]:
        if self._index == 0:  # the service lives in this process
            stop_if_taken_over(self.service, self.ctx)
            if self.service is not None:
                # under the lock `lose` holds: a loss it announces either saw this epoch or is heard now
                with self.global_model.lock:
                    self.service.epochs[0] = self._epoch
                    generation = self.service.generation
                self._hear(generation)
            if kind == MERGE:
                if self.compression != "none":  # rounded as a remote worker's would be, but not sent
                    payload = decode(self.compression, payload, self.global_model.state.numel())
                return self.global_model.apply(0, payload, self.base_version)
            state, version = self.global_model.snapshot(copy=kind == REFRESH)
            return state, version, version - self.base_version
        size = LIVE_HEADER_SIZE if self.live else HEADER_SIZE
        header = torch.tensor([kind, self._index, self.base_version, int(stopping), self._epoch][:size],
                              dtype=torch.int64)
        self._exchange(self.group.isend, header, TAG_REQUEST)
        if kind == MERGE:
            self._exchange(self.group.isend, payload, TAG_PAYLOAD)
        reply = torch.zeros(size, dtype=torch.int64)
        self._exchange(self.group.irecv, reply, TAG_REPLY)
        if self.live:
            if int(reply[4]):
                raise Evicted(f"rank {self.ctx.group.members[self.ctx.rank]}: the other workers went on without "
                              "this one; it did not answer for a while (frozen or too slow)")
            self._hear(int(reply[3]))
        if kind == DONE:
            return None, int(reply[0]), 0
        self._stop_seen = self._stop_seen or bool(reply[2])
        state = None
        if kind in (MERGE, REFRESH):
            state = torch.empty_like(self.base)
            self._exchange(self.group.irecv, state, TAG_GLOBAL)
        return state, int(reply[0]), int(reply[1])

    def _exchange(self, operation, tensor: torch.Tensor, tag: int) -> None:
        """One point-to-point message with rank 0, bounded by the run's timeout; counted both ways. Where the
        workers can take over (`can_take_over`), ServiceLost as soon as rank 0 is judged gone."""
        watching = can_take_over(self.live, self.ctx.group)
        try:
            work = operation(tensor, 0, tag)
            if watching:  # (a wait that times out would close this worker's connections: see Group.wait_looking)
                self.group.wait_looking(work, self.ctx.timeout, lambda: self._look_for_loss(now=True), LOST_POLL)
            else:
                work.wait(timeout=timedelta(seconds=self.ctx.timeout))
        except ServiceLost:
            raise
        except RuntimeError as exc:
            if watching:  # a message to a rank that died fails at once: whether it is gone takes a look or two
                self._look_for_loss(until=time.monotonic() + STALL + 2 * LOST_POLL)
            if watching:
                lost = " (rank 0 is not judged gone: its heartbeat goes on)"
            elif self.live:
                lost = (" (async cannot go on without rank 0, which holds the global model, where rank 0 also hosts "
                        "the run's store: the run ends)")
            else:
                lost = ""
            raise PeerFailure(f"rank {self.ctx.group.members[self.ctx.rank]}: no answer from the merge service on "
                              f"rank {self.group.members[0]} within {self.ctx.timeout:g} s: "
                              f"{first_line(exc)}{lost}") from None
        self.comm_bytes += tensor.numel() * tensor.element_size()

    def merge_now(self) -> int:
        """Send this worker's progress, continue from the new global; returns the staleness of the merge."""
        local = flat_state(self.model)
        if self.merge not in DELTA_MERGES:
            payload = local
        elif self.compression == "none":
            payload = local - self.base
        else:  # encoded bytes of delta + residual; the residual keeps what they drop
            payload = self.feedback.encode(local - self.base)
        state, version, staleness = self._request(MERGE, payload)
        load_flat_state(self.model, state)
        self.base, self.base_version = state, version
        self.merges += 1
        self.max_staleness_seen = max(self.max_staleness_seen, staleness)
        self._diverged = False
        return staleness

    def _refresh_if_stale(self) -> None:
        _, version, staleness = self._request(VERSION)
        if staleness <= self.max_staleness:
            return
        # Rebase: keep this worker's progress since its base, on top of the newer global.
        state, version, _ = self._request(REFRESH)
        local = flat_state(self.model)
        load_flat_state(self.model, state + (local - self.base))
        self.base, self.base_version = state, version
        self.refreshes += 1

    # -- live membership ------------------------------------------------------------------------
    def _look_for_loss(self, *, now: bool = False, until: Optional[float] = None) -> None:
        """A worker other than rank 0, where the workers can take over: ServiceLost if rank 0 is judged gone
        (`RankZeroWatch.look`, which says how and how often)."""
        if self.ctx.rank == 0 or not can_take_over(self.live, self.ctx.group):
            return
        self._watch.look(self.ctx, now=now, until=until)

    def _take_over(self, why: str) -> None:
        """Rank 0 is gone, and with it the global model and the merge service: the workers left regroup
        (`regroup_without_rank_0`), the lowest becomes rank 0 and holds as the global model the newest one any of
        them was given (`newest_global`), and serves the others; they share the data from the first epoch after
        every one's present one."""
        begun = time.perf_counter()
        me = self.ctx.group.members[self.ctx.rank]
        self.group = regroup_without_rank_0(self.ctx, self.group, self._epoch, self.min_workers or 1)
        taken = newest_global(self.ctx.group, self.group, self.base,
                              (self.base_version, self._epoch, self._stop_seen), self._first)
        self.comm_bytes += taken.comm_bytes
        self._stop_seen = self._stop_seen or taken.stop
        self._generation = 0  # the new service counts its generations from here
        self._heard = taken.membership
        self.global_model = self.service = None
        if self.ctx.rank != 0:
            return
        model = GlobalModel(taken.state, self.ctx.world_size, self.merge, self.server_momentum, self.server_lr)
        model.version, model.stop_requested = taken.version, taken.stop
        self._serve(model, taken.epochs)
        print(took_over(why, me, time.perf_counter() - begun, self.ctx.group, taken, self.merge), flush=True)

    def _hear(self, generation: int) -> None:
        """A reply named membership generation `generation`: read what it says if it is news."""
        if generation <= self._generation:
            return
        self._heard = membership_of(self.ctx, generation)
        self._generation = generation

    def members_now(self) -> Optional[tuple[int, ...]]:
        """The workers merging now, by job rank: the service's own list on its host (it leaves a lost worker out
        as soon as it hears of it, before the others take the change at an epoch they share), else the last
        change heard. A checkpoint written after a loss names these, so it counts as complete without the lost
        worker's file. (Sharded, none: its workers are the job's, and a service serves one place of each group.)"""
        if self.service is not None and self.replicas is None:
            with self.service.model.lock:  # (`lose` changes the list under it)
                return tuple(self.group.members[rank] for rank in self.service.members)
        return self._heard.members if self._heard is not None else None

    def live_change(self, epoch: int) -> Optional[Membership]:
        """The membership the workers left share the data in from `epoch` (from 0) on, once: when a worker was
        lost and this epoch is where they all take it (docs/how-to/async.md, "Losing a worker"); else None."""
        heard = self._heard
        if heard is None or heard is self._taken or epoch < heard.epoch:
            return None
        before = self._taken.members if self._taken is not None else self._first
        self._taken = heard
        self.shares.change(epoch, heard.members)
        return replace(heard, left=tuple(rank for rank in before if rank not in heard.members))

    def epoch_plan(self, ctx: DistContext, n_samples: int, labels, batch_size: int, seed: int, shuffle: str,
                   block_size: Optional[int] = None) -> EpochPlan:
        """The shared sharding, over the live members once the trainer took a change (`live_change`)."""
        if self._taken is None:
            return super().epoch_plan(ctx, n_samples, labels, batch_size, seed, shuffle, block_size)
        members, me = self._taken.members, ctx.group.members[ctx.rank]
        return shard_plan(n_samples, members.index(me), len(members), batch_size, seed, shuffle, block_size)

    def _final_group(self) -> None:
        """At the end, after rank 0 concluded: the workers left, in a group of their own, if any was lost."""
        if self._generation == 0:
            return
        heard, ctx = self._heard, self.ctx
        group = ctx.group.rebuild(heard.members, heard.generation)
        assert group is not None, "a worker left out was told so in its last reply"
        ctx.rank, ctx.world_size, ctx.group = group.rank, group.world_size, group

    # -- hooks ---------------------------------------------------------------------------------
    def trains_in_epoch(self, epoch: int) -> bool:
        if not self._began:  # this attempt's first epoch (a resumed run's first after its checkpoint)
            self.shares.begin(epoch, self.ctx.group.members, self.live_unit)
            self._began = True
        self._epoch = epoch
        return True

    def after_step(self, step: int) -> None:
        self._diverged = True
        if self.ctx.world_size > 1 and self.live:
            stop_if_taken_over(self.service, self.ctx)
            try:
                self._look_for_loss()
            except ServiceLost as lost:
                self._take_over(str(lost))
        if self.max_staleness is not None and self._merging > 1:
            self._refresh_if_stale()

    def end_epoch(self, epoch: int) -> bool:
        self._epoch = epoch + 1
        if (epoch + 1) % self.every == 0 and self._diverged:
            self.merge_now()
        return True  # a global model always exists: rank 0 evaluates it

    def averaging_events(self) -> int:
        return self.merges

    def evaluation_target(self) -> tuple[Optional[nn.Module], object]:
        """Rank 0 evaluates a copy holding the current global model, alone: no one waits for it. With a sharded
        model the ranks of replica group 0, which host its shards, evaluate it together (their group steps together
        anyway): each loads its shards of the global model into its shards of a copy sharded as the model is."""
        if self.global_model is None:
            return None, False
        if self.replicas is None:
            snapshot = copy.deepcopy(self.model)
            load_flat_state(snapshot, self.global_model.snapshot()[0])
            return snapshot, False
        load_flat_state(self._global_copy, self.global_model.snapshot()[0])
        return self._global_copy, self.replicas.inside

    def finish(self) -> nn.Module:
        """Last merge, then the one barrier of the run: everyone adopts the final global model.

        If some rank stopped to be continued meanwhile, there is no final model: Preempted,
        after this rank's last checkpoint, as for a signal of its own."""
        if self._diverged:
            self.merge_now()
        if self.ctx.world_size > 1:
            if self._conclusion() == STOP:
                raise Preempted(f"rank {self.ctx.rank}: another rank stopped the run before it finished; "
                                "run the same command again to continue")
            if self._index == 0 and self.service is not None:
                self._hear(self.service.generation)
            self._final_group()
            if self.ctx.world_size > 1:  # (sharded: each shard of the global model from group 0's rank holding it)
                across = self.replicas.across if self.replicas is not None else self.ctx.group
                self.comm_bytes += broadcast_module(self.model, group=across)
            counts = self.ctx.group.gather_objects("summary", (self.merges, self.refreshes, self.max_staleness_seen))
        else:
            load_flat_state(self.model, self.global_model.snapshot()[0])
            counts = [(self.merges, self.refreshes, self.max_staleness_seen)]
        self._final = {"merges": [c[0] for c in counts], "refreshes": [c[1] for c in counts],
                       "max_staleness_seen": max(c[2] for c in counts)}
        if self.live:  # the ranks of the job lost on the way (also where no epoch was left to share the data out)
            self._final["left"] = [rank for rank in self._first if rank not in self.ctx.group.members]
        return self.model

    def _conclusion(self) -> int:
        """This worker done: FINISH or STOP, as the host of its service concluded; a host (rank 0 now, after a
        take-over, too) waits for the others, concludes and takes the global model (sharded: its shards)."""
        outcome = self._request(DONE)[1] if self._index != 0 else 0  # (0 from a worker that took over meanwhile)
        if self._index != 0:
            return outcome
        if self.service is not None:  # (none when this worker alone was left)
            self.service.join()
            stop_if_taken_over(self.service, self.ctx)
        outcome = STOP if self.global_model.stop_requested else FINISH
        if self.service is not None:
            self.service.conclude(outcome)
        load_flat_state(self.model, self.global_model.snapshot()[0])
        return outcome

    # -- agreement without a barrier ------------------------------------------------------------
    def gather_stats(self, stats):
        """Only this rank's numbers live (nobody waits); workers_history gathers everyone's at the end. They are
        named by this worker's rank of the job (a take-over renumbers the group), and once a merge has brought
        the epoch's work into the global model they go to the store too, so that a worker lost later keeps the
        epochs it merged in the records (dptrain.strategies.async_records)."""
        mine = replace(stats, rank=self.ctx.group.members[self.ctx.rank])
        merged, self._merges_recorded = self.merges > self._merges_recorded, self.merges
        store = self.ctx.group.store if self.ctx.world_size > 1 else None
        # (end_epoch just set _epoch to the epoch this worker starts next: the one ended, counted from 1)
        self.shares.finished(self._epoch, asdict(mine), merged, store)
        return [mine]

    def agree_stop(self, requested: Optional[str]) -> Optional[str]:
        """This rank's own signal, or another rank's as the service last reported it. With a sharded model the
        ranks of a replica group stop together (they step together): any of them that heard of a stop from its
        service stops them all, and in group 0 each service then carries the stop to the others' next merge."""
        others = self.global_model.stop_requested if self.global_model is not None else self._stop_seen
        if self.replicas is not None and self.replicas.inside is not None:
            others = self.replicas.inside.any_rank("a stop", bool(requested or others)) and not requested
        if (requested or others) and self.global_model is not None:
            self.global_model.stop_requested = True
        return requested or ("a signal to another rank" if others else None)

    def stop_together(self) -> None:
        """Rank 0 keeps the store and the service up until every other rank is done, then stops them all."""
        if self.ctx.world_size == 1:
            return
        if self._index != 0:
            self._request(DONE, stopping=True)
        if self._index == 0 and self.service is not None:  # (rank 0 now, after a take-over, too)
            self.service.join()
            self.service.conclude(STOP)

    def untrained_shares(self, epochs: int) -> list[Share]:
        """After finish (every worker left has merged all it trained): the shares of epochs 0..`epochs`-1 that no
        merge brought into the global model, the same on every worker left. Rank 0 puts together the records:
        the workers' own (gathered), its checkpoint's, and those of lost workers from the store."""
        self.shares.all_merged()
        unsure = []
        for records, doubted in self.ctx.group.gather_objects("metrics", (self.shares.state_dict()["records"],
                                                                          sorted(self.shares.unsure))):
            self.shares.add(records)
            unsure += [tuple(pair) for pair in doubted]
        owed = None
        if self.ctx.rank == 0:
            self.shares.read_missing(self.ctx.group.store if len(self._first) > 1 else None, epochs)
            self.shares.drop_unsettled(unsure)
            owed = self.shares.untrained(epochs)
        return [tuple(share) for share in self.ctx.group.gather_objects("untrained shares", owed)[0]]

    def workers_history(self, history: list[dict]) -> Optional[dict[int, list[dict]]]:
        """Every worker's numbers of each epoch whose work it merged, in the order of their ranks of the job
        (`untrained_shares` put them together); None where the run only ever had one worker."""
        if all(len(members) == 1 for _, members in self.shares.plans):
            return None
        return {record["epoch"]: sorted(self.shares.records[record["epoch"]].values(), key=lambda w: w["rank"])
                for record in history if self.shares.records.get(record["epoch"])}

    def state_dict(self) -> dict:
        # Async checkpoints are approximate: each rank saves at its own epoch end, rank 0 the
        # global model as it stands then (merges arrive in a run-dependent order anyway).
        state = super().state_dict()
        state.update(base=self.base, base_version=self.base_version, merges=self.merges, refreshes=self.refreshes,
                     max_staleness_seen=self.max_staleness_seen, diverged=self._diverged)
        if self.ctx is not None and self.ctx.rank == 0 and self.ctx.world_size > 1:
            # the others' merged epochs, read before the global model is copied below: each it holds is in that
            # model (what a resumed run takes as merged: TrainedShares.drop_unsettled)
            self.shares.read_missing(self.ctx.group.store, self._epoch)
        state["shares"] = self.shares.state_dict()
        if self.compression != "none":
            state["feedback"] = self.feedback.state_dict()
        if self.global_model is not None:
            state["global"] = self.global_model.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        # (checkpoints load on the CPU; the base is taken from the model, so it lives where the model does)
        self.base, self.base_version = state["base"].to(self.base.device), state["base_version"]
        self.merges, self.refreshes = state["merges"], state["refreshes"]
        self.max_staleness_seen, self._diverged = state["max_staleness_seen"], state["diverged"]
        if "shares" in state:  # (a checkpoint of an older dptrain has none: its epochs are not accounted)
            self.shares.load_state_dict(state["shares"], host="global" in state)
        if self.compression != "none" and "feedback" in state:
            self.feedback.load_state_dict(state["feedback"])
        if self.global_model is not None and "global" in state:
            self.global_model.load_state_dict(state["global"])
        # A rank that resumes at a newer version than rank 0's saved global sees negative
        # staleness once; clamp it so the refresh rule stays meaningful.
        if self.global_model is not None:
            self.base_version = min(self.base_version, self.global_model.version)

    def continue_as_copy(self) -> None:
        super().continue_as_copy()
        self.merges = self.refreshes = 0  # its merges are counted from here on (the copied ones are its source's)

    def refused_with_sharding(self, shard: str) -> Optional[str]:
        """The settings a sharded async refuses (dptrain.strategies.rules.sharding), given from Python."""
        return averaging_refused(self.name, shard, {"compression": self.compression})

    def summary(self) -> dict:
        return dict(self._final or {})

    def describe(self) -> dict:
        described = {"name": self.name, "every": self.every, "merge": self.merge, "max_staleness": self.max_staleness,
                     "compression": self.compression}
        if self.merge == "delayed-nesterov":
            described.update(server_momentum=self.server_momentum, server_lr=self.server_lr)
        return {**described, **self.sharding()}
