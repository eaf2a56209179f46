"""A lost replica group replaced whole (--shard hybrid --min-workers --replace-workers, issue 34 item 5): the launcher
starts S new ranks, which join at an epoch end as a new replica group sharded over their own process group, each
rank healed from its peer in a live group over the groups across (its shards: never a whole model, never a file).
From then on the run is the run that had those replica groups: bit for bit the survivors' checkpoint of the epoch
before the join resumed on as many ranks."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from dptrain.data.sampler import replica_plan
from test_train_cli import dptrain

TRAIN_ROWS = 1437  # digits: 1797 rows, 20 % held out
BATCH, SEED, EPOCHS = 32, 0, 6
# rank 0's steps 120x as long: epochs long enough (about 1 s here) for the new ranks to start before the run ends
SLOW = ["--slow-worker", "0:120"]


def _argv(strategy: str, workers: int, min_workers: int, out) -> list[str]:
    extra = ["--outer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9"] if strategy == "sync" else []
    return ["train", "--dataset", "digits", "--strategy", strategy, *extra, "--workers", str(workers), "--shard",
            "hybrid", "--shard-size", "2", "--min-workers", str(min_workers), "--replace-workers", "--epochs",
            str(EPOCHS), "--batch-size", str(BATCH), "--lr", "0.05", "--timeout", "60", "--keep-checkpoints",
            str(EPOCHS), "--no-progress", *SLOW, "--out", str(out)]


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _joined(history: list[dict]) -> int:
    """The index of the record of the first epoch the new replica group trained in."""
    admitted = [i for i, record in enumerate(history) if record.get("membership", {}).get("joined")]
    assert len(admitted) == 1, [record.get("membership") for record in history]  # (none: it came too late)
    return admitted[0]


def _replaced(root, strategy: str, workers: int, min_workers: int, members: list[int], joiners: list[int]):
    """`workers` ranks in groups of 2, job rank 2 killed halfway through epoch 1 (its partner, rank 3, leaves): the
    run's directory, its output, and the index of the first epoch the replacement group trained in."""
    out = root / strategy
    result = dptrain(*_argv(strategy, workers, min_workers, out), cwd=root,
                     env={"DPTRAIN_FAULT": "train-middle@2:1"}, timeout=300)
    assert result.returncode == 0, result.stderr
    said = result.stdout + result.stderr
    assert "Traceback" not in said
    assert "dptrain: worker rank 2 was killed by SIGKILL; the others go on without it" in result.stderr
    assert (f"dptrain: starting worker ranks {joiners[0]}, {joiners[1]} as a new replica group in place of rank 2's; "
            "they join the others at the next epoch end after all are ready, each healed from its peer in a live "
            "group") in result.stderr
    history = _records(out)
    first = _joined(history)
    change = history[first]["membership"]
    assert change["members"] == members and change["joined"] == joiners and change["left"] == []
    assert change["continued_from_epoch"] == history[first]["epoch"]
    assert (f"dptrain: ranks {joiners[0]}, {joiners[1]} joined after epoch {history[first]['epoch'] - 1}, healed "
            f"from ranks 0, 1, shard by shard") in result.stdout
    return out, result, first


@pytest.fixture(scope="module")
def allreduce_run(tmp_path_factory):
    """allreduce (HSDP) on 4 ranks in 2 groups of 2: group 1 lost in epoch 1, ranks 4 and 5 take its place."""
    return _replaced(tmp_path_factory.mktemp("sharded-replace"), "allreduce", 4, 1, [0, 1, 4, 5], [4, 5])


def test_every_row_is_read_once_in_every_epoch_by_the_groups_of_that_epoch(allreduce_run):
    run, _, first = allreduce_run
    history = _records(run)
    assert [record["epoch"] for record in history] == list(range(1, EPOCHS + 1))
    assert [len(record["workers"]) for record in history] == [2] * first + [4] * (EPOCHS - first)
    for epoch, record in enumerate(history):
        world = len(record["workers"])
        plans = [replica_plan(TRAIN_ROWS, rank, world, 2, BATCH, SEED, "global").rows(epoch) for rank in range(world)]
        assert [worker["samples"] for worker in record["workers"]] == [len(rows) for rows in plans]
        assert np.array_equal(np.sort(np.concatenate(plans)), np.arange(TRAIN_ROWS))


def test_the_heal_moved_each_shard_once_over_the_group_and_no_whole_model(allreduce_run):
    """What travelled (summed over the 2 groups across) is the model and its SGD momentum once each, shard by shard,
    with each sender's random state and plain values (history, epoch): no more than that, and no file read."""
    run, _, first = allreduce_run
    model = torch.load(run / "model.pt", weights_only=True)
    model_bytes = sum(tensor.numel() * tensor.element_size() for tensor in model.values())
    healed = _records(run)[first]["membership"]["healed_bytes"]
    assert 2 * model_bytes <= healed < 2 * model_bytes + 64_000


def test_the_new_group_holds_the_same_shards_as_the_live_one(allreduce_run):
    """HSDP keeps every replica group equal: rank 4 (5) ends with the shards of rank 0 (1), bit for bit."""
    run, _, _ = allreduce_run
    last = run / "checkpoints" / f"epoch-{EPOCHS:06d}"
    assert json.loads((last / "checkpoint.json").read_text())["members"] == [0, 1, 4, 5]
    saved = {rank: torch.load(last / f"rank-{rank:05d}.pt", weights_only=True) for rank in (0, 1, 4, 5)}
    for live, new in ((0, 4), (1, 5)):
        assert saved[live]["model"].keys() == saved[new]["model"].keys()
        assert all(torch.equal(saved[live]["model"][key], saved[new]["model"][key]) for key in saved[live]["model"])


def test_the_run_ends_where_the_survivors_checkpoint_resumed_on_4_ranks_ends(allreduce_run, tmp_path):
    """After the heal the run is the run of 2 replica groups from the survivors' state: its model.pt equals, bit for
    bit, that of the survivors' checkpoint of the epoch before the join (written by ranks 0 and 1) resumed on 4
    ranks in groups of 2."""
    run, _, first = allreduce_run
    copy = tmp_path / "resumed"
    shutil.copytree(run, copy)
    for epoch in range(first + 1, EPOCHS + 1):
        shutil.rmtree(copy / "checkpoints" / f"epoch-{epoch:06d}")
    for name in ("model.pt", "summary.json"):
        (copy / name).unlink()
    result = dptrain(*_argv("allreduce", 4, 1, copy), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    resumed, replaced = (torch.load(path / "model.pt", weights_only=True) for path in (copy, run))
    assert resumed.keys() == replaced.keys()
    assert all(torch.equal(resumed[key], replaced[key]) for key in replaced)


def test_sync_with_an_outer_optimizer_heals_the_anchor_and_momentum_shards(tmp_path):
    """sync --outer nesterov on 6 ranks in 3 groups of 2, group 1 lost: ranks 6 and 7 join, each healed with its peer's
    shards of the model, the outer anchor and the outer momentum. Every epoch ends in an average and an outer step
    that each rank takes from its own anchor and momentum, so the last checkpoint's shards are equal across the 3
    groups only if the new group's were healed exactly."""
    run, _, _ = _replaced(tmp_path, "sync", 6, 2, [0, 1, 4, 5, 6, 7], [6, 7])
    last = run / "checkpoints" / f"epoch-{EPOCHS:06d}"
    saved = {rank: torch.load(last / f"rank-{rank:05d}.pt", weights_only=True) for rank in (0, 1, 4, 5, 6, 7)}
    for place in (0, 1):
        live, others = saved[place], [saved[4 + place], saved[6 + place]]
        for other in others:
            assert all(torch.equal(live["model"][key], other["model"][key]) for key in live["model"])
            assert all(torch.equal(a, b) for a, b in zip(live["strategy"]["anchor"], other["strategy"]["anchor"]))
            momentum = [entry["momentum_buffer"] for entry in live["strategy"]["outer"]["state"].values()]
            assert momentum and all(torch.equal(a, entry["momentum_buffer"]) for a, entry in
                                    zip(momentum, other["strategy"]["outer"]["state"].values()))
