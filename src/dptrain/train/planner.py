"""This rank's epoch plans over a run: which rows it reads each epoch, for the world it trains in now.

The plan is the strategy's (dptrain.strategies.base.Strategy.epoch_plan); after the world changed
(a membership change, a resume on another number of workers) `replan` makes it again, with the
schedule made again over the new epoch length at the same point of the run.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Callable, Optional

from dptrain.data import sharding
from dptrain.data.sampler import EpochPlan, PlanBatches, Rest, labels_of, loader


def rest_steps(rest: Optional[Rest], epoch: int, at: int = 0) -> Optional[int]:
    """The steps left of `epoch` from its step `at` (the rest's start, if later) in the rest of it the workers go
    on with, or None."""
    if rest is None or rest.epoch != epoch or not rest.done:
        return None
    return rest.done + rest.steps - max(rest.done, at)


def agree_on_shards(stream, each: list[dict]) -> None:
    """Every rank must plan over the same shards (else their steps differ and a collective would wait): one line
    naming the ranks that disagree with rank 0, and what each counted."""
    differ = [rank for rank, print_ in enumerate(each) if print_ != each[0]]
    if differ:
        from dptrain.errors import UserError
        counts = ", ".join(f"rank {rank}: {each[rank]['rows']}" for rank in [0, *differ])
        raise UserError(f"--data {stream.name}: the ranks see different data (samples {counts}); every rank must "
                        "see the same shards (give each rank its own data with a factory taking rank instead)")


class Planner:
    """The epoch plans of `train` for this rank: `plan(rest)` makes the current one (`batches`, `reader`, and
    `common_steps`, the fewest steps any rank takes in an epoch, where checkpoints within one are taken)."""

    def __init__(self, ctx, strategy, train, log: Callable[[str], None], *, batch_size: int, seed: int,
                 shuffle: str, loader_workers: int, checkpoint_every_steps: int, schedule: Optional[Callable]) -> None:
        self.ctx, self.strategy, self.train, self.schedule = ctx, strategy, train, schedule
        self.batch_size, self.seed, self.shuffle, self.loader_workers = batch_size, seed, shuffle, loader_workers
        self.checkpoint_every_steps = checkpoint_every_steps
        self.labels = lambda: labels_of(train, log)  # asked again after a membership change
        self.common_steps = 0

    def plan(self, rest: Optional[Rest]) -> EpochPlan:
        """This rank's epoch plan, its batches and their reader, for the rank and world it has now (with `rest`,
        the rest of an epoch shared out again, when it is this world's)."""
        ctx, train = self.ctx, self.train
        if getattr(train, "is_stream", False):  # shards read as a stream: the plan is the stream's own
            return self._plan_stream(train, rest)
        if getattr(train, "private", False):  # this rank's own data (dptrain.data.private): all of it, its own way
            plan = self.strategy.private_plan(ctx, len(train), self.batch_size, self.seed)
        else:
            plan = self.strategy.epoch_plan(ctx, len(train), self.labels, self.batch_size, self.seed, self.shuffle,
                                            getattr(train, "block_size", None))
        if rest is not None and rest.members == tuple(ctx.group.members) and rest.size == self.replica_size():
            plan = replace(plan, rest=rest, rank=ctx.rank)
        # Checkpoints within an epoch are taken at the same step on every rank: below the fewest steps any
        # rank takes (fedavg's partitions differ in size), so that each one is complete.
        self.common_steps = (min(ctx.group.gather_objects("steps per epoch", plan.steps))
                             if self.checkpoint_every_steps else 0)
        self.batches = PlanBatches(plan)
        self.reader = loader(train, self.batches, self.loader_workers, pin_memory=ctx.device.type == "cuda")
        return plan

    def _plan_stream(self, stream, rest: Optional[Rest]) -> EpochPlan:
        """A stream's plan (dptrain.data.streams): the same steps on every rank, computed from the shard sizes."""
        from dptrain.data.streams import StreamReader, refuse_stream_run
        agree_on_shards(stream, self.ctx.group.gather_objects("the shards", stream.fingerprint()))
        ours = rest is not None and rest.members == tuple(self.ctx.group.members)  # (else an older world's)
        steps = stream.plan(self.ctx.rank, self.ctx.world_size, self.loader_workers, self.batch_size, self.seed,
                            self.shuffle, rest if ours else None)
        # The strategy sees its plan as for map-style data (streaming counts its steps); one that keeps partitions
        # of its own asks for the labels (refused) or plans other steps than the stream's
        def own_partitions():
            refuse_stream_run(self.strategy.name, True, False)

        shared = self.strategy.epoch_plan(self.ctx, len(stream), own_partitions, self.batch_size, self.seed,
                                          self.shuffle)
        if shared.steps != steps:
            own_partitions()
        self.common_steps = steps if self.checkpoint_every_steps else 0
        self.batches = self.reader = StreamReader(stream, self.loader_workers, self.ctx.device.type == "cuda")
        return EpochPlan(steps, lambda epoch: stream.segments(epoch))

    def replan(self, state, epochs: int, epoch: Optional[int] = None) -> None:
        """After the world changed, before `epoch` (default: the state's) starts in it: the epoch planned again,
        and the schedule made again over the new epoch length at the same point of the run (from within the
        epoch, where the steps of its rest end it), so that a per-step schedule neither runs ahead nor behind."""
        epoch = state.epoch if epoch is None else epoch
        steps = self.plan(state.rest).steps
        if state.scheduler is None:
            return
        rebuilt = self.schedule(state.optimizer, steps, epochs)
        rest = rest_steps(state.rest, epoch, state.position.steps if state.position is not None else 0)
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": a fast-forward, no step
            warnings.simplefilter("ignore")
            for _ in range(epoch * steps + (0 if rest is None else max(0, steps - rest))):
                rebuilt.step()
        state.scheduler = rebuilt

    def share_rows(self, epoch: int, place: int, members: int):
        """The rows of `epoch` that the member at `place` of `members` reads under the shared sharding (None for a
        stream, whose rows are not picked by index)."""
        if getattr(self.train, "is_stream", False):
            return None
        return sharding.epoch_indices(len(self.train), place, members, epoch, self.seed, self.shuffle,
                                      getattr(self.train, "block_size", None))

    def replica_size(self) -> int:
        """The ranks of each replica group (a sharded model, dptrain.strategies.sharded), 1 unsharded."""
        replicas = getattr(self.strategy, "replicas", None)
        return replicas.size if replicas is not None else 1

    def whole_epoch(self, epoch: int, members, size: int = 1, batch_size: Optional[int] = None) -> Rest:
        """The rows of `epoch` as `members` share them (a stream's positions: StreamRest; in replica groups of
        `size` ranks, each rank reading `batch_size` rows a step, by default this run's): what the rest of an
        epoch is cut from."""
        batch_size = self.batch_size if batch_size is None else batch_size
        if getattr(self.train, "is_stream", False):
            from dptrain.data.streams import StreamRest
            return StreamRest.whole_stream(epoch, len(self.train), members, batch_size, self.loader_workers,
                                           self.seed, self.shuffle)
        return Rest.whole(epoch, len(self.train), members, batch_size, self.seed, self.shuffle,
                          getattr(self.train, "block_size", None), size)

    def lineage(self, rest: Optional[Rest], epoch: int) -> list:
        """How `epoch` is shared out now, as a checkpoint within it records it (`rest_on_resume`): the rest's
        lineage, or this world's whole epoch; lists of ints."""
        if rest is not None and rest.epoch == epoch:
            steps = rest.lineage
        else:
            steps = ((tuple(self.ctx.group.members), 0, self.replica_size(), self.batch_size),)
        return [[list(members), done, size, batch] for members, done, size, batch in steps]

    def rest_on_resume(self, saved: dict) -> Optional[Rest]:
        """From a checkpoint within an epoch (`saved`, as Checkpointer.restore gives it): the rest of that epoch
        as it was shared out when written (its position's lineage), shared out again over this world where its
        writers, or the size of their replica groups, differ from this run's; None where the plan of this world
        reads it already. Refused for a stream on another world (dptrain.data.streams.refuse_stream_run)."""
        position, members, here = saved["position"], tuple(saved["members"]), tuple(self.ctx.group.members)
        lineage = position.get("plan") or [[members, 0, saved.get("shard_size") or 1, self.batch_size]]
        size = self.replica_size()
        if len(lineage) == 1 and (tuple(lineage[0][0]), lineage[0][2], lineage[0][3]) == (here, size, self.batch_size):
            return None  # (the whole epoch of this very world)
        if members != here and getattr(self.train, "is_stream", False):
            from dptrain.data.streams import refuse_stream_run
            refuse_stream_run(self.strategy.name, False, True)
        (first, _, written, batch), *later = lineage
        rest = self.whole_epoch(saved["epoch"], tuple(first), written, batch)
        for members_then, done, size_then, batch_then in later:
            rest = rest.after(done, tuple(members_then), batch_then, size_then)
        if (rest.members, rest.size) != (here, size) or lineage[-1][3] != self.batch_size:
            rest = rest.after(position["steps"], here, self.batch_size, size)
        return rest
