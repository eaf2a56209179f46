"""Sharded replicas with an outer step (--outer, DiLoCo) under sync, and fedavg with one client per replica group:
the same weights as the unsharded runs they stand for, each client's partition read once, the outer optimizer's
anchor and momentum kept as this rank's shards (in checkpoints too, resumed bit for bit), one-line refusals."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from torch import nn

from distributed import run_distributed, toy_data
from dptrain.data.sampler import PlanBatches, partition_plan, partition_replica_plan
from dptrain.data import sharding
from dptrain.errors import UserError
from dptrain.strategies import FedAvg, Sync
from dptrain.train.trainer import Trainer
from test_sharded import test_what_sharding_refuses_is_one_line_before_anything_runs as refused_in_one_line

N, BATCH = 64, 4
RELATIVE = 1e-6  # the float tolerance of the equalities (sums in another order)
HYBRID = {"shard": "hybrid", "shard_size": 2}
# Seed 2's Dirichlet partitions of the 64 toy rows over 2 clients hold 24 and 40 rows: unequal weights, and every
# step of 8 rows splits evenly over a replica group's 2 ranks (where it does not, see docs/how-to/sharding.md).
FEDAVG_SEED = 2


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


_sync_outer = partial(Sync, every_steps=2, outer="nesterov")
_fedavg = partial(FedAvg, partition="dirichlet", alpha=0.5, proximal_mu=0.1, outer="sgd", outer_lr=0.8)


def _train(rank, world, make, batch, epochs, sharded, seed, out=None, resume=False):
    """Train with momentum SGD; (the full state on rank 0, the sizes of this rank's anchor tensors and of its
    parameter shards, the strategy's summary, the bytes this rank handed to collectives)."""
    from dptrain.runtime.sharded import full_state, local

    x, y = toy_data(N)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    strategy = make()
    trainer = Trainer(model, optimizer, "cross-entropy", strategy, batch_size=batch, seed=seed, verbose=False,
                      progress=False, out=out, resume=resume, checkpoint_every=1 if out else 0, **sharded)
    trainer.fit((x, y), epochs=epochs)
    final = strategy.finish()
    anchor = [a.numel() for a in strategy.averager.anchor]
    shards = [local(p).numel() for p in final.parameters()]
    summary = strategy.summary() if hasattr(strategy, "summary") else {}
    return full_state(final), anchor, shards, summary, strategy.comm_bytes


def _relative(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)


def test_hybrid_sync_with_an_outer_step_equals_the_unsharded_run_and_keeps_its_anchor_as_shards():
    # The Nesterov outer step every 2 steps on 2 replica groups of 2 ranks = on 2 unsharded workers with 2 x batch.
    unsharded = run_distributed(_train, 2, _sync_outer, 2 * BATCH, 2, {}, 0)
    hybrid = run_distributed(_train, 4, _sync_outer, BATCH, 2, HYBRID, 0)
    assert _relative(hybrid[0][0], unsharded[0][0]) < RELATIVE
    plain = run_distributed(_train, 4, partial(Sync, every_steps=2), BATCH, 2, HYBRID, 0)
    assert _relative(plain[0][0], hybrid[0][0]) > 1e-3  # the outer step changed the weights: it really ran
    assert [each[4] for each in hybrid] == [each[4] for each in plain]  # and handed nothing more to collectives
    whole = [p.numel() for p in _model().parameters()]
    for rank in range(4):  # each rank's anchor is its own parameter shards: half the rows of each
        anchor, shards = hybrid[rank][1], hybrid[rank][2]
        assert anchor == shards and sum(anchor) < sum(whole)
    assert [a + b for a, b in zip(hybrid[0][1], hybrid[1][1])] == whole
    assert unsharded[0][1] == whole


def test_hybrid_fedavg_equals_unsharded_fedavg_of_one_client_per_replica_group():
    # Dirichlet partitions, FedProx's pull and a server step with momentum: each replica group of 2 ranks is the
    # unsharded client of the same index with twice the batch, its average weighted by its 24 or 40 rows.
    unsharded = run_distributed(_train, 2, _fedavg, 2 * BATCH, 3, {}, FEDAVG_SEED)
    hybrid = run_distributed(_train, 4, _fedavg, BATCH, 3, HYBRID, FEDAVG_SEED)
    assert unsharded[0][3]["partition_sizes"] == [24, 40]
    assert all(hybrid[rank][3]["partition_sizes"] == [24, 40] for rank in range(4))
    assert _relative(hybrid[0][0], unsharded[0][0]) < RELATIVE
    assert hybrid[0][2] != [p.numel() for p in _model().parameters()]  # really sharded


@pytest.mark.parametrize("make,seed", [
    (partial(FedAvg, partition="dirichlet", optimizer_state="average", outer="nesterov"), FEDAVG_SEED),
    (partial(Sync, every_steps=2, optimizer_state="reset", outer="adam"), 0),
], ids=["fedavg-average", "sync-reset"])
def test_the_workers_optimizer_state_is_averaged_or_reset_shard_by_shard_as_unsharded(make, seed):
    # The momentum buffers are shards: averaged (weighted by the groups' samples) with the ranks holding the same
    # shards, or dropped at every average, as the unsharded workers' whole ones are.
    unsharded = run_distributed(_train, 2, make, 2 * BATCH, 2, {}, seed)[0][0]
    hybrid = run_distributed(_train, 4, make, BATCH, 2, HYBRID, seed)[0][0]
    assert _relative(hybrid, unsharded) < RELATIVE


@pytest.mark.parametrize("sizes,size,batch", [([24, 40], 2, 4), ([203, 77, 1000], 4, 5), ([9, 13], 3, 1)])
def test_a_replica_group_reads_its_clients_partition_once_an_epoch_as_the_unsharded_client_does(sizes, size, batch):
    order = np.random.default_rng(0).permutation(sum(sizes))
    parts = [np.sort(order[sum(sizes[:k]):sum(sizes[:k + 1])]) for k in range(len(sizes))]
    for epoch in (0, 3):
        read = []
        for group, part in enumerate(parts):
            plans = [partition_replica_plan(part, group, size, place, batch, 0) for place in range(size)]
            assert len({plan.steps for plan in plans}) == 1  # FSDP's collectives: every rank of a group alike
            ranks = [plan.batches(epoch) for plan in plans]
            assert all(len(rows) for each in ranks for rows in each)  # no rank of a group goes without rows
            client = partition_plan(part, group, size * batch, 0)
            for step, rows_of_step in enumerate(sharding.batches(client.rows(epoch), plans[0].steps)):
                # each step's rows are those of the unsharded client's step with size x batch, split over the group
                assert np.concatenate([each[step] for each in ranks]).tolist() == rows_of_step.tolist()
            sampler = PlanBatches(plans[-1])
            sampler.set_epoch(epoch)
            assert [rows for rows in sampler] == [rows.tolist() for rows in ranks[-1]]  # what the loader reads
            read.append(np.concatenate([rows for each in ranks for rows in each]))
            assert sorted(read[-1].tolist()) == part.tolist()  # the partition, each row once
        assert sorted(np.concatenate(read).tolist()) == list(range(sum(sizes)))
    with pytest.raises(UserError, match="client 1's partition holds 2 samples, fewer than the 3 ranks of its "
                                        "replica group"):
        partition_replica_plan(np.arange(2), 1, 3, 0, 4, 0)


@pytest.mark.parametrize("make", [_sync_outer, _fedavg], ids=["sync-outer", "fedavg"])
def test_a_sharded_outer_or_fedavg_checkpoint_resumes_bit_for_bit_with_its_anchor_as_shards(tmp_path, make):
    seed = FEDAVG_SEED if make is _fedavg else 0
    whole = run_distributed(_train, 4, make, BATCH, 2, HYBRID, seed, str(tmp_path / "whole"))[0][0]
    run_distributed(_train, 4, make, BATCH, 1, HYBRID, seed, str(tmp_path / "cut"))
    saved = torch.load(tmp_path / "cut" / "checkpoints" / "epoch-000001" / "rank-00001.pt", weights_only=True)
    anchor = saved["strategy"]["anchor"]
    assert anchor[0].shape == (8, 6) and saved["model"]["0.weight"].shape == (8, 6)  # rank 1's half of 16 x 6
    momentum = saved["strategy"]["outer"]["state"]
    assert momentum and all(entry["momentum_buffer"].shape == anchor[int(index)].shape
                            for index, entry in momentum.items())  # the outer momentum, shards too
    (tmp_path / "cut" / "summary.json").unlink()
    resumed = run_distributed(_train, 4, make, BATCH, 2, HYBRID, seed, str(tmp_path / "cut"), True)[0][0]
    assert all(torch.equal(resumed[key], whole[key]) for key in whole)


@pytest.mark.parametrize("args,line", [
    (["--strategy", "fedavg", "--shard", "full", "--workers", "2"],
     "--shard full makes one replica group of all 2 ranks: fedavg has nothing to average across groups; it needs 2 "
     "replica groups or more of at least 2 ranks each (4 ranks or more), or --shard none"),
    (["--strategy", "fedavg", "--shard", "hybrid", "--compression", "int8"],
     "--shard hybrid is refused with --compression int8"),
    (["--strategy", "sync", "--shard", "hybrid", "--allreduce-epochs", "1"],
     "--shard hybrid is refused with --allreduce-epochs 1"),
    (["--strategy", "sync", "--shard", "hybrid", "--outer", "nesterov", "--compression", "fp16"],
     "--shard hybrid is refused with --compression fp16"),
])
def test_what_sharded_sync_and_fedavg_refuse_is_one_line_before_anything_runs(tmp_path, args, line):
    refused_in_one_line(tmp_path, args, line)  # exit code 2, that line alone, nothing written


@pytest.mark.parametrize("strategy,line", [
    (lambda: FedAvg(compression="bf16"), "--shard hybrid is refused with --compression bf16: "),
    (lambda: Sync(outer="adam", compression="int8"), "--shard hybrid is refused with --compression int8: "),
])
def test_from_python_the_same_settings_are_refused_in_the_same_line(strategy, line):
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy", strategy(),
                      batch_size=BATCH, verbose=False, progress=False, **HYBRID)
    with pytest.raises(UserError) as refused:
        trainer.fit(toy_data(N), epochs=1)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


def test_each_clients_own_data_is_refused_with_sharding_in_one_line():
    from dptrain.strategies.rules.sharding import ShardOptions

    strategy = FedAvg()
    strategy.shard_as(ShardOptions(shard="hybrid", shard_size=2))
    with pytest.raises(UserError) as refused:
        strategy.private_plan(None, N, BATCH, 0)
    assert str(refused.value).startswith("each rank's own data (a --data factory taking rank) is refused with "
                                         "--shard hybrid: the ranks of a replica group read one client's partition")
