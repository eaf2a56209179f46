"""Live membership of sharded replica groups (--shard hybrid --min-workers, counted in replica groups): a rank lost in
a group loses that group's shards, its other ranks leave in one line, the other groups go on from their own state,
every row read once in every epoch; --shard full and what is not built are refused in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from distributed import run_distributed, toy_data
from dptrain.config import build_config
from dptrain.data.sampler import replica_plan
from dptrain.errors import UserError
from dptrain.strategies.rules.sharding import FULL_LIVE_REFUSED
from test_train_cli import dptrain

TRAIN_ROWS = 1437  # digits: 1797 rows, 20 % held out
BATCH, SEED = 32, 0


def _argv(strategy: str, out) -> list[str]:
    return ["train", "--dataset", "digits", "--strategy", strategy, "--workers", "6", "--shard", "hybrid",
            "--shard-size", "2", "--min-workers", "2", "--epochs", "3", "--batch-size", str(BATCH), "--lr", "0.05",
            "--timeout", "60", "--keep-checkpoints", "3", "--no-progress", "--out", str(out)]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """6 ranks in 3 replica groups of 2: allreduce (HSDP) with job rank 2 killed halfway through epoch 2 (the lost
    group's rank 3 leaves), sync with rank 1 killed there (rank 0 leaves: rank 2 writes the results from then on)."""
    root = tmp_path_factory.mktemp("sharded-live")
    runs = {}
    for strategy, killed in (("allreduce", 2), ("sync", 1)):
        out = root / strategy
        result = dptrain(*_argv(strategy, out), cwd=root, env={"DPTRAIN_FAULT": f"train-middle@{killed}:2"},
                         timeout=300)
        runs[strategy] = (out, killed, result)
    return runs


def _survivors(killed: int) -> list[int]:
    """The ranks of the job in the replica groups left (groups of 2: the killed rank's is lost)."""
    return [rank for rank in range(6) if rank // 2 != killed // 2]


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy", ["allreduce", "sync"])
def test_the_other_groups_finish_and_the_lost_groups_other_rank_leaves_in_one_line(killed_runs, strategy):
    run, killed, result = killed_runs[strategy]
    partner = killed ^ 1  # the other rank of its replica group
    assert result.returncode == 0, result.stderr
    said = result.stdout + result.stderr
    assert f"dptrain: worker rank {killed} was killed by SIGKILL; the others go on without it" in result.stderr
    names = ", ".join(map(str, _survivors(killed)))
    line = (f"dptrain: rank {partner}: its replica group lost rank {killed}, which held the other shards of its "
            f"model (no second copy is kept); it leaves the run, and the other 2 replica groups go on (ranks {names} "
            "of the job)")
    assert [each for each in said.splitlines() if "its replica group lost" in each] == [f"[rank{partner}] {line}"]
    assert f"worker rank {partner} exited" not in said and "Traceback" not in said  # it left, exit code 75
    lost = ", ".join(str(rank) for rank in range(6) if rank not in _survivors(killed))
    assert (f"[rank{_survivors(killed)[0]}] dptrain: continuing from epoch 2 with 4 workers (ranks {names} of the "
            f"job; without ranks {lost})" in result.stdout)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["epochs"] == 3
    assert summary["strategy_options"]["replica_groups"] == 2


@pytest.mark.parametrize("strategy", ["allreduce", "sync"])
def test_every_row_is_read_once_in_every_epoch_the_lost_one_redone_over_the_groups_left(killed_runs, strategy):
    """Epoch 2 is redone from its start by the 2 groups left, planned over them (replica_plan of 4 ranks in groups
    of 2): what each survivor read is its plan's rows, and the 4 plans hold every row once."""
    run, killed, _ = killed_runs[strategy]
    history = _records(run)
    survivors = _survivors(killed)
    assert [record["epoch"] for record in history] == [1, 2, 3]
    assert [len(record["workers"]) for record in history] == [6, 4, 4]
    assert history[1]["membership"] == {"generation": 1, "members": survivors,
                                        "left": [rank for rank in range(6) if rank not in survivors],
                                        "continued_from_epoch": 2}
    assert all("membership" not in record for record in (history[0], history[2]))
    for record in history:
        assert sum(worker["samples"] for worker in record["workers"]) == TRAIN_ROWS
    for epoch, record in ((1, history[1]), (2, history[2])):  # (epochs from 0)
        plans = [replica_plan(TRAIN_ROWS, rank, 4, 2, BATCH, SEED, "global").rows(epoch) for rank in range(4)]
        assert [worker["samples"] for worker in record["workers"]] == [len(rows) for rows in plans]
        assert np.array_equal(np.sort(np.concatenate(plans)), np.arange(TRAIN_ROWS))


@pytest.mark.parametrize("strategy", ["allreduce", "sync"])
def test_the_survivors_hold_equal_shards_and_model_pt_is_their_model(killed_runs, strategy):
    """Rank j of each surviving group holds the same shard of the model (job ranks 0 and 4, 1 and 5 after group 1
    was lost), and of the optimizer state under allreduce (sync keeps each replica's own, --optimizer-state keep);
    model.pt, written by the lowest rank left (rank 2 after group 0 was lost), is the two shards of a group side by
    side (FSDP2 shards along the first dim)."""
    run, killed, _ = killed_runs[strategy]
    survivors = _survivors(killed)
    last = run / "checkpoints" / "epoch-000003"
    assert json.loads((last / "checkpoint.json").read_text())["members"] == survivors
    saved = {rank: torch.load(last / f"rank-{rank:05d}.pt", weights_only=True) for rank in survivors}
    first = survivors[0]
    for one, other in ((first, 4), (first + 1, 5)):
        a, b = saved[one], saved[other]
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][key], b["model"][key]) for key in a["model"])
        for index, entry in (a["optimizer"]["state"].items() if strategy == "allreduce" else ()):
            assert all(torch.equal(value, b["optimizer"]["state"][index][name]) for name, value in entry.items()
                       if isinstance(value, torch.Tensor))
    model = torch.load(run / "model.pt", weights_only=True)
    for key, whole in model.items():
        halves = torch.cat([saved[first]["model"][key], saved[first + 1]["model"][key]])
        assert torch.equal(halves[:whole.shape[0]], whole)


def test_the_survivors_end_where_the_epoch_1_checkpoint_resumed_on_their_4_ranks_ends(killed_runs, tmp_path):
    """What the 2 groups left go on from is their own state of epoch 1's end: the allreduce run's model.pt is, bit
    for bit, that of its epoch-1 checkpoint (written by the 6 ranks) resumed on 4 ranks in groups of 2."""
    run, _, _ = killed_runs["allreduce"]
    copy = tmp_path / "resumed"
    shutil.copytree(run, copy)
    for name in ("epoch-000002", "epoch-000003"):
        shutil.rmtree(copy / "checkpoints" / name)
    for name in ("model.pt", "summary.json"):
        (copy / name).unlink()
    argv = _argv("allreduce", copy)
    argv[argv.index("--workers") + 1] = "4"
    result = dptrain(*argv, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert [len(record["workers"]) for record in _records(copy)] == [6, 4, 4]
    resumed, survived = (torch.load(path / "model.pt", weights_only=True) for path in (copy, run))
    assert resumed.keys() == survived.keys() and all(torch.equal(resumed[key], survived[key]) for key in survived)


def test_dptrain_join_adds_no_worker_to_a_sharded_run_and_says_so_in_one_line(killed_runs):
    run = killed_runs["allreduce"][0]
    result = dptrain("join", str(run), cwd=run.parent)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"dptrain: error: the run in '{run}' shards its model (--shard hybrid), which takes no worker from dptrain "
        "join: a replica group joins whole, in place of a lost one, started by the run's launcher "
        "(--replace-workers); the groups left go on without one")


def test_full_sharding_is_refused_with_min_workers_in_one_line(tmp_path):
    out = tmp_path / "run"
    result = dptrain("train", "--dataset", "digits", "--epochs", "1", "--workers", "2", "--shard", "full",
                     "--min-workers", "1", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "dptrain: error: invalid settings in the command line: --shard full is refused with --min-workers: its one "
        "replica group holds the "
        "only copy of each shard, so a lost rank loses the model (no second copy is kept); give --shard hybrid "
        "--shard-size S, where --min-workers counts replica groups")
    assert not out.exists()


def _full_with_min_workers(rank, world, strategy="AllReduce", shard="full"):
    from torch import nn

    import dptrain
    from dptrain.train.trainer import Trainer

    x, y = toy_data(16)
    model = nn.Linear(6, 3)
    sizes = {"shard_size": 2} if shard == "hybrid" else {}
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy",
                      getattr(dptrain, strategy)(), batch_size=4, verbose=False, progress=False,
                      shard=shard, min_workers=1, **sizes)
    try:
        trainer.fit((x, y))
    except UserError as exc:
        return str(exc)
    return None


def test_the_python_api_refuses_full_sharding_with_min_workers_too():
    assert run_distributed(_full_with_min_workers, 2) == [FULL_LIVE_REFUSED] * 2


def _streaming_with_min_workers(rank, world):
    return _full_with_min_workers(rank, world, "Streaming", "hybrid")


def test_the_python_api_refuses_a_strategy_not_built_to_lose_a_replica_group():
    assert run_distributed(_streaming_with_min_workers, 4) == [
        "--shard hybrid with --min-workers (counted in replica groups) is refused with --strategy streaming "
        "(allreduce or sync only)"] * 4


@pytest.mark.parametrize("values, why", [
    ({"min_workers": 3}, "--min-workers 3, more than the 2 replica groups of 2 ranks \\(use 1 to 2\\)"),
    ({"shard_size": None, "min_workers": 1}, "no --shard-size \\(it counts replica groups of --shard-size ranks"),
    ({"strategy": "sync", "min_workers": 1}, "--strategy sync and --min-workers 1 \\(one replica group left has "
                                             "nobody to average with"),
    ({"commit_every_steps": 2}, "--commit-every-steps or --max-workers \\(a lost replica group's epoch is redone"),
    ({"max_workers": 4}, "--commit-every-steps or --max-workers \\(a lost replica group's epoch is redone"),
])
def test_what_live_sharding_does_not_hold_is_refused_in_one_line(values, why):
    given = {"dataset": "digits", "strategy": "allreduce", "workers": 4, "shard": "hybrid", "shard_size": 2,
             "min_workers": 2, **values}
    with pytest.raises(UserError, match="^invalid settings in the settings: --shard hybrid with --min-workers "
                                        f"\\(counted in replica groups\\) is refused with {why}"):
        build_config({key: value for key, value in given.items() if value is not None})
