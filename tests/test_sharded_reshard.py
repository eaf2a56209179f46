"""A sharded checkpoint continued with replica groups of another size (dptrain.train.reshard): each rank reads its
rows of one writing group's files, the weights and optimizer state after resume are the writer's bit for bit, the
run then goes on as the unsharded run it stands for (float tolerance), and what is not resharded is one line."""

from __future__ import annotations

import shutil
from functools import partial

import pytest
import torch
from torch import nn

from distributed import run_distributed, toy_data
from dptrain.errors import UserError
from dptrain.strategies import AllReduce, Sync
from dptrain.strategies.streaming import Streaming
from dptrain.train.reshard import rows
from dptrain.train.trainer import Trainer

N, BATCH, SEED = 64, 4, 0
RELATIVE = 1e-6  # the float tolerance of a continuation (the same sums over other ranks, in another order)
FULL, HYBRID, NONE = {"shard": "full"}, {"shard": "hybrid", "shard_size": 2}, {}


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def _run(rank, world, batch, epochs, sharded, out, resume):
    """AllReduce with momentum, a checkpoint each epoch; the full weights on rank 0 (every rank unsharded), the
    full momentum of each parameter gathered on every rank, and the files this rank's resume read."""
    from dptrain.runtime.sharded import full_state

    x, y = toy_data(N)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(model, optimizer, "cross-entropy", AllReduce(), batch_size=batch, seed=SEED, verbose=False,
                      progress=False, out=out, resume=resume, checkpoint_every=1, keep_checkpoints=5, **sharded)
    trainer.fit((x, y), epochs=epochs)
    momentum = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            buffer = optimizer.state[parameter]["momentum_buffer"]
            momentum.append(buffer.full_tensor() if hasattr(buffer, "full_tensor") else buffer.clone())
    return full_state(trainer.strategy.finish()), momentum, trainer.checkpointer.read_from


def _written(run, epoch, ranks):
    """The whole weights and momentum a replica group (its job ranks, in place order) saved: its shards joined."""
    files = [torch.load(run / "checkpoints" / f"epoch-{epoch:06d}" / f"rank-{rank:05d}.pt", weights_only=True)
             for rank in ranks]
    model = {key: torch.cat([f["model"][key] for f in files]) for key in files[0]["model"]}
    momentum = [torch.cat([f["optimizer"]["state"][index]["momentum_buffer"] for f in files])
                for index in sorted(files[0]["optimizer"]["state"])]
    return model, momentum


def _cut(run, copy, after):
    """A copy of `run` as if killed right after the checkpoint of epoch `after` (no later checkpoint, no model.pt)."""
    shutil.copytree(run, copy)
    for later in (copy / "checkpoints").iterdir():
        if later.name > f"epoch-{after:06d}":
            shutil.rmtree(later)
    for name in ("model.pt", "summary.json"):
        (copy / name).unlink()
    return copy


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def _relative(a, b):
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """--shard full on 4 ranks for 2 epochs, and --shard hybrid --shard-size 2 on 4 for 1."""
    root = tmp_path_factory.mktemp("written")
    full = run_distributed(_run, 4, BATCH, 2, FULL, str(root / "full"), False)
    run_distributed(_run, 4, BATCH, 1, HYBRID, str(root / "hybrid"), False)
    return root, full


def test_torch_chunk_rows_are_fsdp2s_shards():
    # FSDP2 shards by torch.chunk, an empty chunk for a rank past the last row (_fsdp_common._chunk_with_empty)
    for n in (1, 3, 5, 6, 8, 16):
        for size in (1, 2, 3, 4, 8):
            chunks = list(torch.arange(n).chunk(size)) + [torch.arange(0)] * size
            assert [tuple(range(*rows(n, size, place))) for place in range(size)] == \
                   [tuple(chunk.tolist()) for chunk in chunks[:size]]


def test_the_writers_files_are_its_shards_and_join_into_model_pt(written):
    root, _ = written
    model, _ = _written(root / "hybrid", 1, [0, 1])
    assert _same(model, torch.load(root / "hybrid" / "model.pt", weights_only=True))
    # the other replica group holds the same state (allreduce)
    assert _same(_written(root / "hybrid", 1, [2, 3])[0], model)


@pytest.mark.parametrize("writer,reader,world,batch,read_from", [
    ("full", HYBRID, 4, BATCH, [[0, 1], [2, 3], [0, 1], [2, 3]]),  # full on 4 -> hybrid, 2 groups of 2
    ("full", FULL, 2, 2 * BATCH, [[0, 1], [2, 3]]),  # full on 4 -> full on 2
    # full on 4 -> full on 8: the last layer's 3 rows leave ranks 3 to 7 none of it
    ("full", FULL, 8, BATCH // 2, [[0], [0, 1], [1, 2], [1], [2], [2], [3], [3]]),
    ("full", NONE, 1, 4 * BATCH, [[0, 1, 2, 3]]),  # full on 4 -> unsharded, one worker
    ("hybrid", FULL, 4, BATCH, [[0], [0], [1], [1]]),  # hybrid of 2 on 4 -> full on 4: one group's files only
    ("hybrid", NONE, 4, BATCH, [[0, 1], [2, 3], [0, 1], [2, 3]]),  # -> unsharded on 4: group r mod 2's files
])
def test_a_resharded_resume_is_the_writers_state_bit_for_bit_read_from_one_groups_rows(
        tmp_path, written, writer, reader, world, batch, read_from):
    root, _ = written
    run = _cut(root / writer, tmp_path / "run", 1)
    ranks = run_distributed(_run, world, batch, 1, reader, str(run), True)  # resumed at epoch 1: nothing trains
    model, momentum = _written(root / writer, 1, [0, 1, 2, 3] if writer == "full" else [0, 1])
    assert _same(ranks[0][0], model)
    assert all(len(mine) == len(momentum) and all(torch.equal(a, b) for a, b in zip(mine, momentum))
               for _, mine, _ in ranks)
    assert [read for _, _, read in ranks] == read_from


@pytest.mark.parametrize("reader,world,batch", [(FULL, 2, 2 * BATCH), (NONE, 1, 4 * BATCH)])
def test_a_resharded_run_goes_on_as_the_writer_would_have(tmp_path, written, reader, world, batch):
    # One replica group of 4 ranks x 4 rows reads what one of 2 x 8 or one unsharded worker x 16 reads: the epoch
    # after the resume computes the writer's second epoch, momentum and all, in float rounding.
    root, full = written
    run = _cut(root / "full", tmp_path / "run", 1)
    resumed = run_distributed(_run, world, batch, 2, reader, str(run), True)[0][0]
    assert _relative(resumed, full[0][0]) < RELATIVE
    assert _same(torch.load(run / "model.pt", weights_only=True), resumed)


def _strategy_run(rank, world, make, batch, epochs, sharded, out, resume):
    """A strategy whose own state holds shards (`make()`), with momentum SGD and a checkpoint each epoch; the full
    weights on rank 0 and the test loss of each epoch (streaming's: of its global model)."""
    from dptrain.runtime.sharded import full_state

    x, y = toy_data(N)
    model = _model()
    strategy = make()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "cross-entropy", strategy,
                      batch_size=batch, seed=SEED, verbose=False, progress=False, out=out, resume=resume,
                      checkpoint_every=1, keep_checkpoints=5, **sharded)
    trainer.fit((x, y), toy_data(32), epochs=epochs)
    return full_state(strategy.finish()), [record["test_loss"] for record in trainer.recorder.history]


@pytest.mark.parametrize("make", [partial(Sync, every_steps=2, outer="nesterov"),
                                  partial(Streaming, every_steps=2, overlap_steps=1, fragments=3)],
                         ids=["sync-outer-nesterov", "streaming"])
def test_a_strategys_own_shards_are_resharded_too_and_the_run_goes_on_as_the_writer_would_have(tmp_path, make):
    # --outer's anchor and Nesterov momentum, streaming's global model (which differs from the replicas at the
    # epoch's end): shards in each rank's file. 2 replica groups of 2 ranks x 4 rows compute what 2 unsharded
    # workers x 8 rows do, so the writer's 2nd epoch and the one resumed unsharded on 2 agree in float rounding
    # (streaming's global model is what the test loss is of: one of its 3 fragments is not averaged in epoch 2).
    whole, losses = run_distributed(_strategy_run, 4, make, BATCH, 2, HYBRID, str(tmp_path / "hybrid"), False)[0]
    run = _cut(tmp_path / "hybrid", tmp_path / "run", 1)
    resumed, resumed_losses = run_distributed(_strategy_run, 2, make, 2 * BATCH, 2, NONE, str(run), True)[0]
    assert _relative(resumed, whole) < RELATIVE
    assert len(resumed_losses) == 2 and abs(resumed_losses[1] - losses[1]) <= RELATIVE * losses[1]


def test_a_strategy_state_of_other_shards_is_not_resharded_and_says_so_in_one_line(tmp_path):
    # No strategy sharding allows keeps other shards today (compression's residuals are refused with --shard):
    # a checkpoint written by 2 ranks in one group whose strategy state holds a residual of rows.
    from dptrain.train import checkpoint_files
    from dptrain.train.reshard import Layout, load_resharded

    model = nn.Linear(4, 3)
    for rank, rows_of in enumerate(([0, 1], [2])):
        state = {"epoch": 1, "step": 4, "wall_seconds": 1.0, "scheduler": {}, "scaler": {}, "history": [],
                 "rng": checkpoint_files.rng_state(),
                 "model": {"weight": model.weight.detach()[rows_of], "bias": model.bias.detach()[rows_of]},
                 "optimizer": {"state": {}, "param_groups": [{"params": [0, 1]}]},
                 "strategy": {"comm_bytes": 0, "feedback": {"residual": torch.zeros(len(rows_of), 4)}}}
        checkpoint_files.save(tmp_path, 1, rank, state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UserError) as refused:
        load_resharded(tmp_path, 1, [0, 1], 2, Layout(1, 0, 0), model, optimizer)
    assert str(refused.value) == (f"the checkpoint of epoch 1 in '{tmp_path}' was written by replica groups of 2 "
                                  "ranks, and its strategy state holds their shards beyond those resharded "
                                  "(streaming's global model, --outer's anchor and momentum, async's merge "
                                  "vectors): continue it with "
                                  "replica groups of 2 ranks")
    (tmp_path / "checkpoints" / "epoch-000001" / "rank-00001.pt.sha256").write_text("0" * 64)
    with pytest.raises(UserError, match="rank-00001.pt' is missing or does not match its checksum"):
        load_resharded(tmp_path, 1, [0, 1], 2, Layout(1, 0, 0), model, optimizer)


def test_from_the_command_line_a_sharded_run_goes_on_unsharded(tmp_path):
    from test_train_cli import dptrain

    common = ["train", "--dataset", "digits", "--workers", "2", "--out", str(tmp_path / "run"), "--no-progress"]
    first = dptrain(*common, "--epochs", "1", "--shard", "full", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    # --shard and --shard-size may change between a run and its continuation; the launcher checks the first
    # rank's shards against the model before the workers start
    went_on = dptrain(*common, "--epochs", "2", cwd=tmp_path)
    assert went_on.returncode == 0, went_on.stderr
    assert ("dptrain: the checkpoint's shards resharded from replica groups of 2 ranks onto unsharded workers: "
            "each rank read its rows of one writing group's files") in went_on.stdout
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert saved["1.weight"].shape == (128, 64)  # whole again


def test_a_continued_sharded_run_may_change_its_unit_and_recompute_its_activations(tmp_path):
    # A requeue that ran out of memory goes on with activation checkpointing and smaller units: the checkpoint's
    # shards are rows of each parameter whatever the units, so it continues as the run would have (float rounding)
    from test_train_cli import dptrain

    common = ["train", "--dataset", "digits", "--workers", "2", "--no-progress", "--shard", "full"]
    whole = dptrain(*common, "--out", str(tmp_path / "whole"), "--epochs", "2", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    first = dptrain(*common, "--out", str(tmp_path / "run"), "--epochs", "1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    went_on = dptrain(*common, "--out", str(tmp_path / "run"), "--epochs", "2", "--shard-unit", "Linear",
                      "--shard-checkpoint", cwd=tmp_path)
    assert went_on.returncode == 0, went_on.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    a, b = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("run", "whole"))
    assert _relative(a, b) < RELATIVE


@pytest.mark.parametrize("size", [1, 3])
def test_asyncs_vectors_are_resharded_row_by_row(tmp_path, size):
    # async keeps flat vectors of a rank's rows of each parameter, then the floating buffers whole (its merge base;
    # on a service's host its shard of the global model and the server momentum): written by a group of 2 (rows
    # [0, 2) and [2, 3) of each 3-row parameter), read unsharded and by a group of 3 (one row each).
    from dptrain.train import checkpoint_files
    from dptrain.train.reshard import Layout, load_resharded

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    model[1].running_mean.uniform_()
    params, buffers = list(model.parameters()), [model[1].running_mean, model[1].running_var]
    other = [torch.randn_like(p) for p in params]  # the global model's values

    def vector(tensors, rows_of):
        return torch.cat([t.detach()[rows_of].reshape(-1) for t in tensors] + [b.reshape(-1) for b in buffers])

    for rank, rows_of in enumerate(([0, 1], [2])):
        strategy = {"comm_bytes": 0, "base": vector(params, rows_of),
                    "global": {"state": vector(other, rows_of), "version": 7, "merges": [3, 4]}}
        state = {"epoch": 1, "step": 4, "wall_seconds": 1.0, "scheduler": {}, "scaler": {}, "history": [],
                 "rng": checkpoint_files.rng_state(), "strategy": strategy,
                 "model": {key: (value[rows_of] if value.dim() and key in dict(model.named_parameters()) else value)
                           for key, value in model.state_dict().items()},
                 "optimizer": {"state": {}, "param_groups": [{"params": [0, 1, 2, 3]}]}}
        checkpoint_files.save(tmp_path, 1, rank, state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for place in range(size):
        mine = list(range(3))[slice(*rows(3, size, place))]
        state, _ = load_resharded(tmp_path, 1, [0, 1], 2, Layout(size, 0, place), model, optimizer)
        assert torch.equal(state["strategy"]["base"], vector(params, mine))
        assert torch.equal(state["strategy"]["global"]["state"], vector(other, mine))
        assert state["strategy"]["global"]["version"] == 7 and state["strategy"]["global"]["merges"] == [3, 4]
