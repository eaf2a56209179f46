"""Rows no worker's training brought into the final model, trained at the end by the workers left.

Without a barrier (async) a worker lost before it merged an epoch takes its share of that epoch with it, and so
does a worker whose file a resumed checkpoint lacks (dptrain.strategies.async_records finds those shares). The
workers left each train an even part of those rows, from the final model, and average: W' merges of those
changes from the same global model would give the same model. Each epoch's record then says how many of its
rows were made up (`rows_made_up`), so that every row of every epoch is counted once.

With a sharded model (async across replica groups) each replica group trains an even part, in steps of its batch
(S x a rank's) whose rows are split over its ranks as every step's are, and the groups then average shard by shard
(each rank with the ranks holding its shards). A step of fewer rows than the group has ranks is taken whole by
each of them: the group's mean gradient is that of those rows all the same.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from dptrain.data import sharding
from dptrain.data.sampler import FixedBatches, loader
from dptrain.strategies.collectives import average_module


def after_finish(trainer, model: nn.Module, epochs: int) -> bool:
    """After the strategy's finish, on the workers left: the recorder follows them (async: a worker lost in the
    last epochs, after the others last shared the data out), and they make up the shares of epochs 0..`epochs`-1
    that no worker's training brought into `model` (Strategy.untrained_shares). Returns whether it changed."""
    ctx, recorder = trainer.ctx, trainer.recorder
    if tuple(ctx.group.members) != (recorder.members or tuple(range(recorder.job_world))):
        recorder.follow(tuple(ctx.group.members))
    shares = ctx.group.bounded("untrained shares", lambda: trainer.strategy.untrained_shares(epochs))
    return make_up(trainer, model, shares)


def make_up(trainer, model: nn.Module, shares: list[tuple[int, int, int]]) -> bool:
    """Train `shares` ((epoch from 0, place, members): the same list on every worker left) on this group, then
    average; record the rows per epoch. Returns whether the model changed."""
    if not shares:
        return False
    ctx, planner, recorder = trainer.ctx, trainer.planner, trainer.recorder
    parts = [(epoch, planner.share_rows(epoch, place, members)) for epoch, place, members in shares]
    if any(rows is None for _, rows in parts):  # a stream: its rows cannot be picked out one by one
        recorder.log(f"dptrain: {len(shares)} share(s) of the stream's epochs that no worker's merge brought into "
                     "the final model are not made up (a stream cannot be read by rows)")
        return False
    counts: dict[int, int] = {}
    for epoch, rows in parts:
        counts[epoch + 1] = counts.get(epoch + 1, 0) + len(rows)
    replicas = getattr(trainer.strategy, "replicas", None)
    batches = _batches(np.concatenate([rows for _, rows in parts]), ctx, replicas, trainer.step_batch)
    model.train()
    for x, y in loader(planner.train, FixedBatches(batches), 0, pin_memory=ctx.device.type == "cuda"):
        trainer.stepper.step(model, x, y)
    across = ctx.group if replicas is None else replicas.across
    if across is not None and across.world_size > 1:
        trainer.strategy.comm_bytes += ctx.group.bounded("averaging the rows made up",
                                                         lambda: average_module(model, group=across))
    recorder.made_up(counts)
    epochs = ", ".join(map(str, sorted(counts)))
    recorder.log(f"dptrain: {sum(counts.values()):,} rows of epoch{'s' if len(counts) > 1 else ''} {epochs} that no "
                 f"worker's merge brought into the global model (a worker lost, or a resume from a checkpoint it "
                 f"had not written) trained now by the run's {ctx.world_size} "
                 f"worker{'s' if ctx.world_size > 1 else ''}, from the final model, then averaged")
    return True


def _batches(rows: np.ndarray, ctx, replicas, batch: int) -> list[list[int]]:
    """This rank's batches of `rows` (the same on every rank): its even part in steps of its batch; sharded, its
    replica group's part in steps of the group's batch, each step's rows split over the group's ranks (all of them
    to each rank where a step has fewer rows than the group has ranks), every rank of a group the same steps."""
    if replicas is None:
        mine = np.array_split(rows, ctx.world_size)[ctx.rank]
        return [each.tolist() for each in sharding.batches(mine, max(1, -(-len(mine) // batch))) if len(each)]
    part, size = np.array_split(rows, replicas.replicas)[replicas.index], replicas.size
    if not len(part):
        return []
    steps = sharding.batches(part, max(1, -(-len(part) // (batch * size))))
    return [(np.array_split(step, size)[replicas.place] if len(step) >= size else step).tolist()
            for step in steps if len(step)]
