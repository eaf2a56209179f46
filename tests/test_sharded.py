"""Sharded replicas (--shard full|hybrid, FSDP2): the same weights as the unsharded runs they stand for, every row
read once, FSDP's collectives counted at the seam, sharded checkpoints that resume bit for bit, one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from distributed import run_distributed, toy_data
from dptrain.data import sharding
from dptrain.data.sampler import PlanBatches, replica_plan, shard_plan
from dptrain.errors import UserError
from dptrain.runtime.sharded import units_of
from dptrain.strategies import AllReduce, Sync
from dptrain.train.trainer import Trainer
from test_train_cli import dptrain

N, BATCH, SEED = 64, 4, 0
RELATIVE = 1e-6  # the float tolerance of the equalities (sums in another order)


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def _parameters():
    return sum(p.numel() for p in _model().parameters())


def _padded_bytes(size):
    """The bytes of the parameters with each one's rows padded to a multiple of `size` (as FSDP2 shards them)."""
    return sum(-(-p.shape[0] // size) * size * p[0].numel() * 4 for p in _model().parameters())


def _train(rank, world, strategy, batch, epochs, sharded, out=None, resume=False):
    """Train with plain SGD (no momentum: local SGD every step is then allreduce); the full state on rank 0,
    this rank's shard sizes, its bytes."""
    from dptrain.runtime.sharded import full_state, local

    x, y = toy_data(N)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, optimizer, "cross-entropy", strategy, batch_size=batch, seed=SEED, verbose=False,
                      progress=False, out=out, resume=resume, checkpoint_every=1 if out else 0, **sharded)
    trainer.fit((x, y), epochs=epochs)
    final = strategy.finish()
    shards = [local(p).numel() for p in final.parameters()]
    return full_state(final), shards, strategy.comm_bytes


def _relative(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)


def test_full_shard_allreduce_equals_unsharded_allreduce_on_the_same_rows():
    # One replica group of 2 ranks reads what one unsharded worker with twice the batch reads.
    unsharded = run_distributed(_train, 1, AllReduce(), 2 * BATCH, 2, {})[0][0]
    ranks = run_distributed(_train, 2, AllReduce(), BATCH, 2, {"shard": "full"})
    assert _relative(ranks[0][0], unsharded) < RELATIVE
    assert ranks[1][0] == {}  # model.pt's whole state is gathered on rank 0 only
    full = [p.numel() for p in _model().parameters()]
    assert [a + b for a, b in zip(ranks[0][1], ranks[1][1])] == full and ranks[0][1] != full  # really sharded
    # Every collective at the seam: the first broadcast, then each step an all-gather of each unit's shard
    # before its forward and again before its backward, and a reduce-scatter of its whole gradient.
    # (FSDP pads each parameter's rows to a multiple of the 2 ranks: the last layer's 3 rows travel as 4.)
    steps = 2 * (N // (2 * BATCH))
    padded = _padded_bytes(2)
    assert ranks[0][2] == ranks[1][2] == _parameters() * 4 + steps * (2 * padded // 2 + padded)


def _reduce_scatter_ops(rank, world, strategy, sharded):
    """The reduce ops FSDP handed the seam's reduce-scatters in one epoch (their names)."""
    from dptrain.runtime.group import Group

    ops, reduce_scatter_into = set(), Group.reduce_scatter_into

    def recorded(self, output, tensor, op=torch.distributed.ReduceOp.SUM, async_op=False):
        ops.add(str(op).rsplit(".", 1)[-1])
        return reduce_scatter_into(self, output, tensor, op, async_op=async_op)

    Group.reduce_scatter_into = recorded
    _train(rank, world, strategy, BATCH, 1, sharded)
    return sorted(ops)


def test_a_replica_group_averages_in_its_reduce_scatter_as_plain_fsdp2_and_hsdp_sums_then_divides_once():
    # Within one group FSDP2 takes gloo's average (no division of dptrain's after it), as a plain FSDP2 script
    # does; HSDP's mean spans the groups too (FSDP would hand gloo PREMUL_SUM, which it lacks): sums, then one
    # division. The weights are the same either way (the exactness tests here).
    assert run_distributed(_reduce_scatter_ops, 2, AllReduce(), {"shard": "full"}) == [["AVG"]] * 2
    hybrid = {"shard": "hybrid", "shard_size": 2}
    assert run_distributed(_reduce_scatter_ops, 4, Sync(), hybrid) == [["AVG"]] * 4
    assert run_distributed(_reduce_scatter_ops, 4, AllReduce(), hybrid) == [["SUM"]] * 4


def test_hybrid_allreduce_and_sync_equal_the_unsharded_runs_of_as_many_replicas():
    hybrid = {"shard": "hybrid", "shard_size": 2}
    allreduce = run_distributed(_train, 2, AllReduce(), 2 * BATCH, 2, {})[0][0]
    hsdp = run_distributed(_train, 4, AllReduce(), BATCH, 2, hybrid)
    assert _relative(hsdp[0][0], allreduce) < RELATIVE
    steps = 2 * (N // 2 // (2 * BATCH))
    padded = _padded_bytes(2)  # and each step, each gradient shard all-reduced across the groups
    assert hsdp[0][2] == _parameters() * 4 + steps * (padded + padded + padded // 2)
    local_sgd = run_distributed(_train, 4, Sync(every_steps=1), BATCH, 2, hybrid)
    assert _relative(local_sgd[0][0], hsdp[0][0]) < RELATIVE
    sync = run_distributed(_train, 2, Sync(), 2 * BATCH, 2, {})[0][0]
    hybrid_sync = run_distributed(_train, 4, Sync(), BATCH, 2, hybrid)
    assert _relative(hybrid_sync[0][0], sync) < RELATIVE


@pytest.mark.parametrize("world,size", [(2, 2), (4, 2), (6, 3), (8, 4), (6, 2)])
def test_replica_groups_read_every_row_once_as_the_unsharded_workers_do(world, size):
    n, batch, replicas = 203, 5, world // size
    for epoch in (0, 3):
        plans = [replica_plan(n, rank, world, size, batch, SEED, "global") for rank in range(world)]
        rows = np.concatenate([plan.rows(epoch) for plan in plans])
        assert sorted(rows.tolist()) == list(range(n))
        assert len({plan.steps for plan in plans}) == 1
        for group in range(replicas):
            worker = shard_plan(n, group, replicas, size * batch, SEED, "global")
            steps = sharding.batches(worker.rows(epoch), worker.steps)
            ranks = [list(PlanBatches(plans[rank]).__iter__()) if plans[rank].batches is None else
                     plans[rank].batches(epoch) for rank in range(group * size, (group + 1) * size)]
            assert all(len(part) for each in ranks for part in each)
            for step, rows_of_step in enumerate(steps):
                assert np.concatenate([each[step] for each in ranks]).tolist() == rows_of_step.tolist()


def test_the_units_are_the_named_class_or_the_children_holding_a_share():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    model = nn.Sequential(nn.Linear(8, 1, bias=False), nn.ModuleList([Block(), Block()]), nn.Linear(8, 8))
    assert [type(m).__name__ for m in units_of(model, None, 0.05)] == ["Block", "Block", "Linear"]
    assert len(units_of(model, "Block", 0.05)) == 2
    with pytest.raises(UserError, match="--shard-unit Layer names no module of the model; its module classes are: "
                                        "Block, Linear, ModuleList"):
        units_of(model, "Layer", 0.05)


@pytest.mark.parametrize("args,line", [
    (["--shard", "hybrid", "--shard-size", "3", "--workers", "4"],
     "--shard-size 3 does not divide the 4 ranks into replica groups; valid sizes: 2, 4"),
    (["--shard", "full", "--strategy", "async"],
     "--shard full makes one replica group of all the ranks: async has nothing to average across groups; give "
     "--shard hybrid with a --shard-size that makes 2 replica groups or more, or --shard none"),
    (["--shard", "full", "--strategy", "async", "--workers", "4"],
     "--shard full makes one replica group of all 4 ranks: async has nothing to average across groups; give "
     "--shard hybrid with --shard-size 2"),
    (["--shard", "full", "--min-workers", "1"], "--shard full is refused with --min-workers"),
    (["--shard", "full", "--strategy", "sync"], "--shard full makes one replica group of all the ranks: sync "),
    (["--shard-size", "2"], "--shard-size applies to --shard hybrid, not --shard none"),
    (["--shard", "full", "--shard-offload", "--device", "cpu"],
     "--shard full is refused with --shard-offload on --device cpu"),
    (["--shard-checkpoint"], "--shard-checkpoint applies to --shard full or hybrid, not --shard none"),
    (["--shard", "hybrid", "--shard-size", "2", "--workers", "2", "--strategy", "sync"],
     "--shard hybrid makes one replica group of all 2 ranks: sync has nothing to average across groups; it needs 2 "
     "replica groups or more of at least 2 ranks each (4 ranks or more), or --shard none"),
    (["--shard", "hybrid", "--shard-size", "6", "--workers", "6", "--strategy", "fedavg"],
     "--shard hybrid makes one replica group of all 6 ranks: fedavg has nothing to average across groups; give "
     "--shard hybrid with --shard-size 2 or 3"),
])
def test_what_sharding_refuses_is_one_line_before_anything_runs(tmp_path, args, line):
    out = tmp_path / "run"
    result = dptrain("train", "--dataset", "digits", "--epochs", "1", "--out", str(out), *args, cwd=tmp_path)
    assert result.returncode == 2
    assert line in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_a_sharded_checkpoint_resumes_bit_for_bit_and_model_pt_is_a_plain_state_dict(tmp_path):
    hybrid = {"shard": "hybrid", "shard_size": 2}
    whole = run_distributed(_train, 4, Sync(), BATCH, 2, hybrid, str(tmp_path / "whole"))[0][0]
    run_distributed(_train, 4, Sync(), BATCH, 1, hybrid, str(tmp_path / "cut"))
    files = sorted(p.name for p in (tmp_path / "cut" / "checkpoints" / "epoch-000001").glob("rank-*.pt"))
    assert files == [f"rank-0000{rank}.pt" for rank in range(4)]  # every rank writes its own shards
    rank_file = torch.load(tmp_path / "cut" / "checkpoints" / "epoch-000001" / "rank-00001.pt", weights_only=True)
    assert rank_file["model"]["0.weight"].shape == (8, 6)  # rank 1's half of the 16 x 6 weight
    resumed = run_distributed(_train, 4, Sync(), BATCH, 2, hybrid, str(tmp_path / "cut"), True)[0][0]
    assert all(torch.equal(resumed[key], whole[key]) for key in whole)
    saved = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)
    assert saved.keys() == _model().state_dict().keys()
    assert all(torch.equal(saved[key], whole[key]) for key in whole)


def test_a_sharded_checkpoint_within_an_epoch_resumes_bit_for_bit(tmp_path):
    import shutil

    full = {"shard": "full"}
    steps = {"checkpoint_every_steps": 3, "keep_checkpoints": 10}
    whole = run_distributed(_train_steps, 2, AllReduce(), BATCH, 2, full, str(tmp_path / "whole"), False, steps)[0]
    checkpoints = tmp_path / "whole" / "checkpoints"
    assert (checkpoints / "epoch-000001-step-000003").is_dir()
    for later in [p for p in checkpoints.iterdir() if p.name > "epoch-000001-step-000003"]:
        shutil.rmtree(later)  # as if killed just after that checkpoint
    for name in ("model.pt", "summary.json"):
        (tmp_path / "whole" / name).unlink()
    resumed = run_distributed(_train_steps, 2, AllReduce(), BATCH, 2, full, str(tmp_path / "whole"), True, steps)[0]
    assert all(torch.equal(resumed[key], whole[key]) for key in whole)


def _train_steps(rank, world, strategy, batch, epochs, sharded, out, resume, steps):
    from dptrain.runtime.sharded import full_state

    x, y = toy_data(N)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(model, optimizer, "cross-entropy", strategy, batch_size=batch, seed=SEED, verbose=False,
                      progress=False, out=out, resume=resume, **steps, **sharded)
    trainer.fit((x, y), epochs=epochs)
    return full_state(strategy.finish())


def test_a_sharded_checkpoint_resumes_on_another_number_of_ranks_with_the_same_shard_size(tmp_path):
    import shutil

    hybrid = {"shard": "hybrid", "shard_size": 2}
    run_distributed(_train, 4, AllReduce(), BATCH, 1, hybrid, str(tmp_path / "four"))  # written by 4 ranks
    written = torch.load(tmp_path / "four" / "model.pt", weights_only=True)
    for world in (2, 8):
        copy = tmp_path / f"on-{world}"
        shutil.copytree(tmp_path / "four", copy)
        for name in ("model.pt", "summary.json"):
            (copy / name).unlink()
        loaded = run_distributed(_train, world, AllReduce(), BATCH, 1, hybrid, str(copy), True)[0][0]
        assert all(torch.equal(loaded[key], written[key]) for key in written), world


USER_MODELS = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x))


def make(input_shape, num_outputs):
    inputs = int(torch.tensor(input_shape).prod())
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, 16), Block(16), Block(16), nn.Linear(16, num_outputs))
'''


def test_a_model_of_your_own_file_shards_by_its_class_and_a_class_it_lacks_is_one_line(tmp_path):
    (tmp_path / "mymodels.py").write_text(USER_MODELS)
    common = ["train", "--dataset", "digits", "--model", "./mymodels.py:make", "--shard", "full", "--workers", "2",
              "--epochs", "1", "--no-progress"]
    done = dptrain(*common, "--shard-unit", "Block", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert sorted(saved) == ["1.bias", "1.weight", "2.linear.bias", "2.linear.weight", "3.linear.bias",
                             "3.linear.weight", "4.bias", "4.weight"] and saved["1.weight"].shape == (16, 64)
    refused = dptrain(*common, "--shard-unit", "Layer", "--out", str(tmp_path / "refused"), cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip() == ("dptrain: error: --shard-unit Layer names no module of the model; its module "
                                      "classes are: Block, Flatten, Linear")
    assert not (tmp_path / "refused").exists()


def test_activation_checkpointing_and_bf16_parameters_train_as_they_should():
    plain = run_distributed(_train, 2, AllReduce(), BATCH, 1, {"shard": "full"})[0]
    recomputed = run_distributed(_train, 2, AllReduce(), BATCH, 1, {"shard": "full", "shard_checkpoint": True})[0]
    assert _relative(recomputed[0], plain[0]) < RELATIVE and recomputed[2] == plain[2]  # the same computation
    bf16 = run_distributed(_train, 2, AllReduce(), BATCH, 1, {"shard": "full", "shard_precision": "bf16"})[0]
    assert all(value.dtype == torch.float32 for value in bf16[0].values())  # the shards stay fp32
    assert 0 < _relative(bf16[0], plain[0]) < 0.05  # computed in bf16: close, not equal
    # Parameters all-gathered in bf16 (half the bytes), gradients reduce-scattered in fp32.
    steps, padded = N // (2 * BATCH), _padded_bytes(2)
    assert bf16[2] == _parameters() * 4 + steps * (2 * padded // 2 // 2 + padded)


def test_the_lr_guard_keeps_a_sharded_average_as_this_ranks_shards():
    # --lr-scaling auto's guard (a scaled LR) keeps the last good average to come back to: here, shards.
    guarded = {"shard": "hybrid", "shard_size": 2, "lr_scale": 2.0}
    ranks = run_distributed(_train, 4, Sync(), BATCH, 2, guarded)
    assert all(torch.isfinite(value).all() for value in ranks[0][0].values())
    # Rank 1's shard of the last layer (3 rows over 2 ranks) is a row of 8 and a bias shorter than rank 0's: each
    # of the 2 averages (all-reduces of the unpadded shards) hands over 9 floats fewer.
    assert ranks[0][2] - ranks[1][2] == 2 * 9 * 4


FSDP_SCRIPT = '''
import json, os
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")  # env://, as dptrain run sets it
mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))  # from LOCAL_WORLD_SIZE, RANK, WORLD_SIZE
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model(torch.ones(3, 4)).sum().backward()
with open(f"rank{dist.get_rank()}.json", "w") as handle:
    json.dump({"shard_rows": model[0].weight.to_local().shape[0], "local_world": os.environ["LOCAL_WORLD_SIZE"]},
              handle)
dist.destroy_process_group()
os._exit(0)
'''


def test_dptrain_run_gives_a_script_that_shards_itself_the_mesh_environment_it_needs(tmp_path):
    (tmp_path / "fsdp.py").write_text(FSDP_SCRIPT)
    done = dptrain("run", "--workers", "2", "fsdp.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert seen == [{"shard_rows": 4, "local_world": "2"}] * 2  # 8 rows over 2 ranks


def _resume_refused(rank, world, out, make, sharded):
    x, y = toy_data(N)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, optimizer, "cross-entropy", make(), batch_size=BATCH, seed=SEED, verbose=False,
                      progress=False, out=out, resume=True, checkpoint_every=1, **sharded)
    try:
        trainer.fit((x, y), epochs=2)
    except UserError as refused:
        return str(refused)
    return None


def test_a_sharded_checkpoint_within_an_epoch_is_not_resumed_where_the_strategy_cannot_in_one_line(tmp_path):
    # Fedavg's clients are the replica groups, each with its own place in its partition: another shard size within
    # an epoch is refused (allreduce and sync go on: tests/test_sharded_reshard_within.py)
    import shutil

    from dptrain.strategies import FedAvg

    steps = {"checkpoint_every_steps": 3, "keep_checkpoints": 10}
    hybrid = {"shard": "hybrid", "shard_size": 2}
    run = tmp_path / "run"
    run_distributed(_train_steps, 4, FedAvg(), BATCH, 1, hybrid, str(run), False, steps)
    for later in [p for p in (run / "checkpoints").iterdir() if p.name > "epoch-000000-step-000003"]:
        shutil.rmtree(later)  # as if killed just after step 3 of epoch 1
    (run / "summary.json").unlink()
    lines = run_distributed(_resume_refused, 4, str(run), FedAvg, {})
    assert lines == [f"the checkpoint of step 3 of epoch 1 in '{run}' was written within an epoch by replica groups "
                     "of 2 ranks, and fedavg cannot continue it unsharded: a checkpoint within an epoch holds each "
                     "client's place in its own partition, one at an epoch end does not; continue it with groups of 2 "
                     "ranks (an epoch's end reshards onto any size)"] * 4


@pytest.mark.parametrize("strategy,line", [
    # (over 2 ranks fedavg says its one replica group: test_sharded_streaming's test from Python)
    ("fedavg", "--shard full needs at least 2 ranks to shard over, not 1"),
    ("allreduce", "--shard full needs at least 2 ranks to shard over, not 1"),
])
def test_from_python_a_sharding_that_cannot_be_is_one_line_too(strategy, line):
    from dptrain.strategies import FedAvg

    x, y = toy_data(N)
    model = _model()
    chosen = FedAvg() if strategy == "fedavg" else AllReduce()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy", chosen, batch_size=BATCH,
                      verbose=False, progress=False, shard="full")
    with pytest.raises(UserError) as refused:
        trainer.fit((x, y), epochs=1)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="--shard-size applies to --shard hybrid, not --shard full"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), shard="full", shard_size=2)


def test_auto_from_python_refuses_sharding_as_the_command_line_does():
    # auto measures and picks a strategy once running; it has no sharded form, so it refuses before choosing
    from dptrain import Auto
    model = nn.Linear(4, 2)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=Auto(), shard="full")
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    with pytest.raises(UserError, match=r"^--shard full is refused with --strategy auto: "):
        trainer.fit((x, y), epochs=1)
