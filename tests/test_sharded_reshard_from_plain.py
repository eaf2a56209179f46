"""An unsharded checkpoint continued as a sharded run (dptrain.train.reshard): its writers are replica groups of one
whose files hold whole tensors, new replica group g continues from writing rank g mod their number, and each rank
takes its FSDP2 rows of the weights, the optimizer state and the strategy's own state; those are the writer's bit
for bit after the resume, and the run goes on as the unsharded run it stands for (float tolerance). Within an
epoch it is refused in one line."""

from __future__ import annotations

import json

import shutil
from functools import partial

import pytest
import torch
from torch import nn

from distributed import run_distributed, toy_data
from test_sharded_reshard import _cut
from dptrain.strategies import AllReduce, Sync
from dptrain.train.trainer import Trainer

N, BATCH, SEED = 64, 4, 0
RELATIVE = 1e-6  # the float tolerance of a continuation (the same sums over other ranks, in another order)
FULL, HYBRID, NONE = {"shard": "full"}, {"shard": "hybrid", "shard_size": 2}, {}
SYNC = partial(Sync, every_steps=2, outer="nesterov")


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def _whole(tensor):
    """A parameter or its state whole on every rank of its replica group (a shard's group gathers it)."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _run(rank, world, make, batch, epochs, sharded, out, resume):
    """`make()`'s strategy with momentum SGD and a checkpoint each epoch. Returns this rank's view: the weights and
    momentum of each parameter whole (gathered over its replica group), this rank's own part of the outer step's
    anchor and momentum (its rows, when sharded), its replica group (group, place) and the files its resume read."""
    x, y = toy_data(N)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    strategy = make()
    trainer = Trainer(model, optimizer, "cross-entropy", strategy, batch_size=batch, seed=SEED, verbose=False,
                      progress=False, out=out, resume=resume, checkpoint_every=1, keep_checkpoints=5, **sharded)
    trainer.fit((x, y), epochs=epochs)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    weights = [_whole(p) for p in parameters]
    momentum = [_whole(optimizer.state[p]["momentum_buffer"]) for p in parameters]
    averager = getattr(strategy, "averager", None)
    outer = None
    if averager is not None:
        saved = averager.outer.state_dict()["state"]
        outer = ([a.detach().clone() for a in averager.anchor],
                 [saved[i]["momentum_buffer"].clone() for i in range(len(averager.anchor))])
    layout = trainer.checkpointer.layout()
    strategy.finish()
    return weights, momentum, outer, (layout.group, layout.place), trainer.checkpointer.read_from


def _file(run, epoch, rank):
    return torch.load(run / "checkpoints" / f"epoch-{epoch:06d}" / f"rank-{rank:05d}.pt", weights_only=True)


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _relative(a, b):
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Unsharded on 2 workers x 8 rows a step, 2 epochs: allreduce, and sync every 2 steps with --outer nesterov."""
    root = tmp_path_factory.mktemp("plain")
    return root, {name: run_distributed(_run, 2, make, 2 * BATCH, 2, NONE, str(root / name), False)
                  for name, make in (("allreduce", AllReduce), ("sync", SYNC))}


@pytest.mark.parametrize("writer,make,reader,world,read_from", [
    ("allreduce", AllReduce, FULL, 2, [[0], [0]]),  # one group of 2: both ranks continue from writing rank 0
    ("allreduce", AllReduce, HYBRID, 4, [[0], [0], [1], [1]]),  # group g from writing rank g mod 2
    ("sync", SYNC, HYBRID, 4, [[0], [0], [1], [1]]),
], ids=["allreduce-to-full-on-2", "allreduce-to-hybrid-on-4", "sync-outer-nesterov-to-hybrid-on-4"])
def test_an_unsharded_checkpoint_resumed_sharded_is_the_writers_state_bit_for_bit(
        tmp_path, written, writer, make, reader, world, read_from):
    root, _ = written
    run = _cut(root / writer, tmp_path / "run", 1)
    ranks = run_distributed(_run, world, make, BATCH, 1, reader, str(run), True)  # resumed at epoch 1: no training
    assert [read for *_, read in ranks] == read_from
    size = 2
    for rank, (weights, momentum, outer, (group, place), read) in enumerate(ranks):
        assert (group, place) == (rank // size, rank % size)
        file = _file(root / writer, 1, read[0])  # the writer's whole tensors
        assert _equal(weights, list(file["model"].values()))
        assert _equal(momentum, [file["optimizer"]["state"][i]["momentum_buffer"] for i in range(len(momentum))])
        assert (outer is None) == (writer == "allreduce")
    if writer == "sync":  # the anchor and outer momentum: each rank holds its rows; a group's join into the writer's
        for group in range(world // size):
            members = [ranks[group * size + place] for place in range(size)]
            file = _file(root / writer, 1, group % 2)["strategy"]
            anchor = [torch.cat([m[2][0][i] for m in members]) for i in range(len(file["anchor"]))]
            outer = [torch.cat([m[2][1][i] for m in members]) for i in range(len(file["anchor"]))]
            assert _equal(anchor, file["anchor"])
            assert _equal(outer, [file["outer"]["state"][i]["momentum_buffer"] for i in range(len(anchor))])
            assert all(m[2][0][0].shape[0] == 8 for m in members)  # 16 rows of the first layer, 8 a rank
        # the two writers' momentum differed (sync keeps each worker's own), and so do the two groups'
        assert not _equal(ranks[0][1], ranks[2][1])


@pytest.mark.parametrize("writer,make", [("allreduce", AllReduce), ("sync", SYNC)])
def test_replica_groups_of_2_go_on_as_the_unsharded_writer_would_have(tmp_path, written, writer, make):
    # 2 replica groups of 2 ranks x 4 rows read what the 2 unsharded workers x 8 rows read: the epoch after the
    # resume computes the writer's second epoch (momentum, anchor and outer momentum all), in float rounding.
    root, runs = written
    run = _cut(root / writer, tmp_path / "run", 1)
    resumed = run_distributed(_run, 4, make, BATCH, 2, HYBRID, str(run), True)
    for rank, (weights, *_rest) in enumerate(resumed):
        assert _relative(weights, runs[writer][rank // 2][0]) < RELATIVE


def test_one_group_of_2_goes_on_as_one_unsharded_worker_of_twice_the_batch(tmp_path, written):
    # --shard full on 2 is one replica reading 8 rows a step: not the writer's 2 workers (16 rows a step) but one
    # unsharded worker of 8 continued from the same checkpoint (allreduce resumes on any number of workers).
    root, _ = written
    sharded = run_distributed(_run, 2, AllReduce, BATCH, 2, FULL, str(_cut(root / "allreduce", tmp_path / "a", 1)),
                              True)
    alone = run_distributed(_run, 1, AllReduce, 2 * BATCH, 2, NONE, str(_cut(root / "allreduce", tmp_path / "b", 1)),
                            True)
    assert _relative(sharded[0][0], alone[0][0]) < RELATIVE
    assert _relative(sharded[0][1], alone[0][1]) < RELATIVE
    assert not _equal(sharded[0][0], _file(root / "allreduce", 1, 0)["model"].values())  # it trained an epoch


def test_from_the_command_line_an_unsharded_run_goes_on_sharded_within_an_epoch_and_at_its_end(tmp_path):
    from test_train_cli import dptrain

    common = ["train", "--dataset", "digits", "--workers", "2", "--no-progress", "--keep-checkpoints", "20"]
    first = dptrain(*common, "--out", str(tmp_path / "run"), "--epochs", "1", "--checkpoint-every-steps", "5",
                    cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    # within an epoch: the rest of the epoch (every row the 2 unsharded workers had not read) is shared out again
    # over the one replica group of 2 ranks
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "run", cut)
    for later in [p for p in (cut / "checkpoints").iterdir() if p.name > "epoch-000000-step-000005"]:
        shutil.rmtree(later)
    for name in ("model.pt", "summary.json", "metrics.jsonl"):
        (cut / name).unlink()
    went_on = dptrain(*common, "--out", str(cut), "--epochs", "1", "--checkpoint-every-steps", "5",
                      "--shard", "full", cwd=tmp_path)
    assert went_on.returncode == 0, went_on.stderr
    assert (f"dptrain: resuming at step 5 of epoch 1 from {cut} on 2 workers (written by 2: job ranks 0, 1); the "
            "rest of epoch 1 re-planned over 1 replica group of 2 ranks") in went_on.stdout
    record = json.loads((cut / "metrics.jsonl").read_text())
    assert sum(worker["samples"] for worker in record["workers"]) == 1437  # digits' training rows, each once
    # at an epoch's end: --shard may change on a continued run; the launcher checks the whole tensors against the
    # model, and each rank takes its rows
    went_on = dptrain(*common, "--out", str(tmp_path / "run"), "--epochs", "2", "--checkpoint-every-steps", "5",
                      "--shard", "full", cwd=tmp_path)
    assert went_on.returncode == 0, went_on.stderr
    assert ("dptrain: the unsharded checkpoint sharded onto groups of 2: each rank read its rows of one writer's "
            "file") in went_on.stdout
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    assert torch.load(tmp_path / "run" / "model.pt", weights_only=True)["1.weight"].shape == (128, 64)
