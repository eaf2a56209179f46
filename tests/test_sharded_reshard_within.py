"""A checkpoint within an epoch continued on another world or with replica groups of another size: the rest of the
epoch (every row its writers had not read, once) is shared out again over the new replica groups, and the run goes
on as the unsharded run it stands for would (float tolerance); a checkpoint taken within a rest records how the
epoch was shared out (its lineage), so that resuming it reads that rest again, not the world's whole-epoch plan."""

from __future__ import annotations

import shutil
from functools import partial

import numpy as np
import pytest
import torch
from torch import nn

from distributed import run_distributed, toy_data
from dptrain.data import sharding
from dptrain.data.sampler import PlanBatches, Rest, replica_plan
from dptrain.strategies import AllReduce, Sync
from dptrain.train.trainer import Trainer

N, BATCH, SEED = 64, 4, 0
RELATIVE = 1e-6  # the float tolerance of a continuation (the same sums over other ranks, in another order)
FULL, HYBRID, NONE = {"shard": "full"}, {"shard": "hybrid", "shard_size": 2}, {}
STEPS = {"checkpoint_every_steps": 1, "keep_checkpoints": 50}


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def _run(rank, world, make, batch, epochs, sharded, out, resume):
    """Momentum SGD with a checkpoint every step; the whole weights on rank 0 and the rows each epoch's record
    counts (summed over the ranks)."""
    from dptrain.runtime.sharded import full_state

    x, y = toy_data(N)
    model = _model()
    strategy = make()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "cross-entropy", strategy,
                      batch_size=batch, seed=SEED, verbose=False, progress=False, out=out, resume=resume,
                      **STEPS, **sharded)
    trainer.fit((x, y), epochs=epochs)
    rows = [sum(worker["samples"] for worker in record["workers"]) for record in trainer.recorder.history]
    return full_state(strategy.finish()), rows


def _cut(run, copy, epoch, step):
    """A copy of `run` as if killed right after the checkpoint of step `step` of epoch `epoch` (1-based)."""
    shutil.copytree(run, copy)
    last = f"epoch-{epoch - 1:06d}-step-{step:06d}"
    assert (copy / "checkpoints" / last).is_dir(), sorted(p.name for p in (copy / "checkpoints").iterdir())
    for later in (copy / "checkpoints").iterdir():
        if later.name > last:
            shutil.rmtree(later)
    for name in ("model.pt", "summary.json"):
        (copy / name).unlink()
    return copy


def _relative(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def test_a_replica_groups_rest_is_every_unread_row_once_split_over_the_groups_ranks_as_its_plan_splits_them():
    # 2 groups of 2 ranks x 3 rows; after 2 steps, shared out again over 3 groups of 4 ranks, then 1 group of 2
    n, batch = 203, 3
    members = (0, 1, 2, 3)
    whole = Rest.whole(1, n, members, batch, SEED, "global", size=2)
    for rank in members:  # the whole epoch is what each rank's replica plan reads
        plan = PlanBatches(replace_rest(replica_plan(n, rank, 4, 2, batch, SEED, "global"), None))
        plan.set_epoch(1)
        mine = PlanBatches(replace_rest(replica_plan(n, rank, 4, 2, batch, SEED, "global"), whole, rank))
        mine.set_epoch(1)
        assert list(plan) == list(mine)
    read = {rank: _rows(whole, n, rank, 0, 2) for rank in members}
    first = whole.after(2, tuple(range(12)), batch, size=4)
    assert dict(first.read) == {rank: len(rows) for rank, rows in read.items()}
    assert first.lineage == ((members, 0, 2, batch), (tuple(range(12)), 2, 4, batch))
    read.update({10 + rank: _rows(first, n, rank, 2, 3) for rank in range(12)})  # (keyed apart from the first)
    last = first.after(3, (0, 1), batch, size=2)
    left = [_rows(last, n, rank, 3, 3 + last.steps) for rank in (0, 1)]
    everything = np.concatenate([*read.values(), *left])
    assert sorted(everything.tolist()) == list(range(n))  # every row once


def replace_rest(plan, rest, rank=0):
    from dataclasses import replace
    return replace(plan, rest=rest, rank=rank)


def _rows(rest, n, rank, start, end):
    """The rows that rank `rank` (its place among the rest's members) reads by the rest in steps [start, end) of
    the epoch, in order."""
    batches = PlanBatches(replace_rest(replica_plan(n, 0, 2, 2, BATCH, SEED, "global"), rest, rank))
    batches.set_epoch(rest.epoch, start)
    steps = list(batches)[:end - start]
    return np.concatenate(steps).astype(np.int64) if steps else np.empty(0, dtype=np.int64)


STRATEGIES = {"allreduce": AllReduce, "sync": partial(Sync, every_steps=2)}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Per strategy: 4 ranks in 2 replica groups of 2 x 4 rows, and the 2 unsharded workers x 8 rows they stand for
    (4 steps an epoch), 2 epochs each, a checkpoint every step; made when first asked for."""
    root, made = tmp_path_factory.mktemp("written"), {}

    def get(name):
        if name not in made:
            run_distributed(_run, 4, STRATEGIES[name], BATCH, 2, HYBRID, str(root / name / "sharded"), False)
            run_distributed(_run, 2, STRATEGIES[name], 2 * BATCH, 2, NONE, str(root / name / "plain"), False)
            made[name] = root / name
        return made[name]
    return get


@pytest.mark.parametrize("name,reader,world,unsharded,rows", [
    ("allreduce", FULL, 2, 1, 2),  # 2 groups of 2 -> 1 group of 2: 2 unsharded workers x 8 rows -> 1 x 8
    ("allreduce", FULL, 4, 1, 4),  # -> 1 group of 4 (another shard size): 2 x 8 -> 1 x 16
    ("sync", HYBRID, 8, 4, 2),  # -> 4 groups of 2: 2 x 8 -> 4 x 8
    ("sync", {"shard": "hybrid", "shard_size": 4}, 8, 2, 4),  # -> 2 groups of 4: 2 x 8 -> 2 x 16
    ("sync", NONE, 2, 2, 1),  # -> unsharded: 2 x 8 -> 2 x 4
], ids=["allreduce-fewer-groups", "allreduce-other-shard-size", "sync-more-groups", "sync-other-shard-size",
        "sync-unsharded"])
def test_a_checkpoint_within_an_epoch_goes_on_in_other_replica_groups_as_the_unsharded_run_it_stands_for(
        tmp_path, written, name, reader, world, unsharded, rows):
    # Both cut after step 1 of epoch 1 and continued: the sharded one in `reader` on `world` ranks x 4 rows, the
    # unsharded one on as many workers as there are replica groups now, each reading a group's `rows` x 4 rows a
    # step. (Equal where each step's rows split evenly over a group's ranks, as here: a rank's loss is the mean
    # over its own rows. Sync's cases keep 2 groups or more: one group has nothing to average with.)
    run = written(name)
    make = STRATEGIES[name]
    sharded = run_distributed(_run, world, make, BATCH, 2, reader, str(_cut(run / "sharded", tmp_path / "s", 1, 1)),
                              True)[0]
    plain = run_distributed(_run, unsharded, make, rows * BATCH, 2, NONE, str(_cut(run / "plain", tmp_path / "p", 1, 1)),
                            True)[0]
    assert _relative(sharded[0], plain[0]) < RELATIVE
    assert sharded[1] == plain[1] == [N, N]  # each epoch's record counts every row once


def test_a_checkpoint_taken_within_a_rest_resumes_that_rest_bit_for_bit(tmp_path):
    # Unsharded 3 -> 2 workers within epoch 2, the continuation cut again 2 steps later, within the rest, and
    # resumed on the same 2: it reads the rest recorded in its checkpoint, not the whole epoch planned over 2.
    world_steps = sharding.steps_per_epoch(N, 3, BATCH)
    run_distributed(_run, 3, AllReduce, BATCH, 2, NONE, str(tmp_path / "three"), False)
    once = _cut(tmp_path / "three", tmp_path / "once", 2, 2)
    whole, rows = run_distributed(_run, 2, AllReduce, BATCH, 2, NONE, str(once), True)[0]
    assert rows == [N, N]
    assert world_steps > 4
    twice = _cut(once, tmp_path / "twice", 2, 4)
    again, rows = run_distributed(_run, 2, AllReduce, BATCH, 2, NONE, str(twice), True)[0]
    assert rows == [N, N]
    assert all(torch.equal(again[key], whole[key]) for key in whole)
    # and sharded: 2 groups of 2 -> 1 group of 4 at step 3 of epoch 1, cut again at step 4 (within the rest)
    run_distributed(_run, 4, AllReduce, BATCH, 2, HYBRID, str(tmp_path / "sharded"), False)
    once = _cut(tmp_path / "sharded", tmp_path / "s-once", 1, 2)
    whole, _ = run_distributed(_run, 4, AllReduce, BATCH, 2, FULL, str(once), True)[0]
    again, rows = run_distributed(_run, 4, AllReduce, BATCH, 2, FULL, str(_cut(once, tmp_path / "s-twice", 1, 3)),
                                  True)[0]
    assert rows == [N, N]
    assert all(torch.equal(again[key], whole[key]) for key in whole)
