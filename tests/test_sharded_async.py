"""async across sharded replica groups (--shard hybrid --strategy async): one merge service per place of a replica
group, each holding that shard of the global model; the same weights as the unsharded async run it stands for
where the order of merges cannot matter, every group ending on one global model, no rank holding a whole one,
and a stop on one rank of one group stopping every rank with a checkpoint that the same command continues."""

from __future__ import annotations

import json
import os
import signal
import time
from functools import partial

import pytest
import torch
from torch import nn

from cli_runner import ForkedDptrain, run_dptrain
from distributed import run_distributed, toy_data
from dptrain.strategies import Async
from dptrain.train import checkpoint_files
from dptrain.train.trainer import Trainer
from test_sharded import test_what_sharding_refuses_is_one_line_before_anything_runs as refused_in_one_line
from test_train_cli import DIGITS

N, BATCH = 64, 4
RELATIVE = 1e-6  # the float tolerance of the equalities (sums in another order)
HYBRID = {"shard": "hybrid", "shard_size": 2}


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def _train(rank, world, make, batch, epochs, sharded):
    """Train with momentum SGD; (this rank's group's full final state, the size of the global model this rank
    holds (0: none), the sizes of its parameter shards, the strategy's summary, the rows it read each epoch)."""
    from dptrain.runtime.sharded import full_state, local

    x, y = toy_data(N)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    strategy = make()
    trainer = Trainer(model, optimizer, "cross-entropy", strategy, batch_size=batch, seed=0, verbose=False,
                      progress=False, **sharded)
    trainer.fit((x, y), epochs=epochs)
    history = trainer.history
    held = strategy.global_model.state.numel() if strategy.global_model is not None else 0
    shards = [local(p).numel() for p in model.parameters()]
    rows = [sum(worker["samples"] for worker in record["workers"]) for record in history] if rank == 0 else None
    return full_state(model, wanted=True), held, shards, strategy.summary(), rows


def _relative(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)


@pytest.mark.parametrize("merge", ["delta", "delayed-nesterov"])
def test_one_epoch_of_hybrid_async_equals_unsharded_async_of_one_worker_per_replica_group(merge):
    # Over one epoch every group merges once from the initial model, so the order of the merges cannot matter:
    # the global model is the mean of the groups' models (delayed-nesterov: plus its momentum step on that mean),
    # as for 2 unsharded workers with 2 x the batch.
    make = partial(Async, merge=merge)
    unsharded = run_distributed(_train, 2, make, 2 * BATCH, 1, {})
    hybrid = run_distributed(_train, 4, make, BATCH, 1, HYBRID)
    assert _relative(hybrid[0][0], unsharded[0][0]) < RELATIVE
    other = run_distributed(_train, 2, make, BATCH, 1, {})  # another batch: other weights (the comparison can fail)
    assert _relative(other[0][0], unsharded[0][0]) > 1e-3
    for rank in range(4):  # every group ends on the global model
        assert all(torch.equal(hybrid[rank][0][k], hybrid[0][0][k]) for k in hybrid[0][0])
    assert hybrid[0][3]["merges"] == [1, 1, 1, 1]


def test_over_several_epochs_every_group_ends_on_one_global_model_held_as_shards_and_reads_every_row_once():
    hybrid = run_distributed(_train, 6, partial(Async, max_staleness=2), BATCH, 3, HYBRID)  # 3 groups of 2
    final = hybrid[0][0]
    for rank in range(6):
        assert all(torch.equal(hybrid[rank][0][k], final[k]) for k in final)
    whole = sum(p.numel() for p in _model().parameters())
    # Group 0's ranks host the services: each holds its shards of the global model, together the whole model once;
    # the other groups' ranks hold none.
    assert [each[1] for each in hybrid] == [sum(hybrid[0][2]), sum(hybrid[1][2]), 0, 0, 0, 0]
    assert hybrid[0][1] + hybrid[1][1] == whole and max(hybrid[0][1], hybrid[1][1]) < whole
    assert hybrid[0][3]["merges"] == [3] * 6
    assert hybrid[0][4] == [N, N, N]  # every row once in each epoch


class _Ordered(Async):
    """Async whose replica groups (or workers) merge in a fixed order: each waits `delays[its index]` seconds
    before each merge (group 0, which hosts the services, checkpoints right after its own)."""

    def __init__(self, delays: dict) -> None:
        super().__init__()
        self.delays = delays

    def merge_now(self) -> int:
        time.sleep(self.delays[self._index])
        return super().merge_now()


def _resumed(rank, world, batch, sharded, out, resume, make=Async, n=N, momentum=0.9):
    """One epoch with a checkpoint (or, resumed after it, none to train); the final full state and the records.
    (`momentum` 0: what a worker trains from the final model then depends on that model alone, not on the optimizer
    state its checkpoint held.)"""
    from dptrain.runtime.sharded import full_state

    x, y = toy_data(n)
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), "cross-entropy", make(),
                      batch_size=batch, seed=0, verbose=False, progress=False, out=out, resume=resume,
                      checkpoint_every=1, **sharded)
    trainer.fit((x, y), epochs=1)
    return full_state(model, wanted=True), trainer.history


def _cut(run):
    for name in ("model.pt", "summary.json"):
        (run / name).unlink()


def test_rows_no_saved_merge_holds_are_made_up_by_the_groups_as_by_unsharded_workers(tmp_path):
    # 3 groups of 2 (48 rows: 16 each), resumed on 2 groups from group 0's checkpoint, which group 2's merge came
    # after: group 2's 16 rows are made up, each group training 8 of them (one step split over its 2 ranks) from the
    # final model, then the groups average shard by shard. As 3 unsharded workers resumed on 2 do with 2 x the batch.
    ordered = partial(_Ordered, {1: 0.0, 0: 0.5, 2: 2.0})  # group 2 merges after group 0's checkpoint
    run_distributed(_resumed, 6, BATCH, HYBRID, str(tmp_path / "hybrid"), False, ordered, 48)
    run_distributed(_resumed, 3, 2 * BATCH, {}, str(tmp_path / "plain"), False, ordered, 48)
    _cut(tmp_path / "hybrid")
    _cut(tmp_path / "plain")
    hybrid = run_distributed(_resumed, 4, BATCH, HYBRID, str(tmp_path / "hybrid"), True, Async, 48)
    plain = run_distributed(_resumed, 2, 2 * BATCH, {}, str(tmp_path / "plain"), True, Async, 48)
    assert hybrid[0][1][0]["rows_made_up"] == plain[0][1][0]["rows_made_up"] == 16
    assert sum(worker["samples"] for worker in hybrid[0][1][0]["workers"]) == 48 - 16  # with those: every row once
    assert _relative(hybrid[0][0], plain[0][0]) < RELATIVE
    for rank in range(4):  # every group ends on one model
        assert all(torch.equal(hybrid[rank][0][key], hybrid[0][0][key]) for key in hybrid[0][0])


@pytest.mark.parametrize("world,sharded", [(2, {}), (4, HYBRID)], ids=["unsharded", "groups-of-2"])
def test_a_merge_that_came_after_the_hosts_checkpoint_is_made_up_on_resume_as_a_missing_file_is(tmp_path, world,
                                                                                                  sharded):
    # The last worker (or replica group) merges 2 s after the first, which hosts the global model and checkpoints
    # right after its own merge: the global model in the checkpoint lacks the late merge, though the late worker's
    # own file, written after it, says it merged. Resumed, its rows are made up at the end, exactly as if its file
    # were missing (lost before saving); they used to count as in the model, and that work was lost.
    size, n = sharded.get("shard_size", 1), 32
    for name in ("own", "missing"):
        run_distributed(partial(_resumed, momentum=0.0), world, BATCH, sharded, str(tmp_path / name), False,
                        partial(_Ordered, {0: 0.0, 1: 2.0}), n)
        _cut(tmp_path / name)
    for rank in range(size, world):  # the late worker's (group's) files
        for suffix in ("", ".sha256"):
            (tmp_path / "missing" / "checkpoints" / "epoch-000001" / f"rank-{rank:05d}.pt{suffix}").unlink()
    plain = partial(_resumed, momentum=0.0)
    own, missing = (run_distributed(plain, world, BATCH, sharded, str(tmp_path / name), True, Async, n)
                    for name in ("own", "missing"))
    assert own[0][1][0]["rows_made_up"] == missing[0][1][0]["rows_made_up"] == n // 2
    assert sum(worker["samples"] for worker in own[0][1][0]["workers"]) == n // 2  # with those: every row once
    for rank in range(world):
        assert all(torch.equal(own[rank][0][key], missing[rank][0][key]) for key in missing[0][0])


@pytest.mark.parametrize("reader,world", [({}, 2), ({"shard": "hybrid", "shard_size": 3}, 6)],
                         ids=["unsharded", "groups-of-3"])
def test_a_checkpoint_continues_on_another_shard_size_from_the_global_model_the_services_saved(tmp_path, reader, world):
    # group 1 merges first, group 0 (the services' hosts) a second later, then checkpoints: both merges are in
    # the saved global model, and its host's records say so (a merge after it would be made up: the test above)
    run_distributed(_resumed, 4, BATCH, HYBRID, str(tmp_path), False, partial(_Ordered, {0: 1.0, 1: 0.0}))
    files = [torch.load(tmp_path / "checkpoints" / "epoch-000001" / f"rank-{rank:05d}.pt", weights_only=True)
             for rank in (0, 1)]  # group 0's ranks: the hosts of the global model's 2 shards
    vectors = [f["strategy"]["global"]["state"] for f in files]
    saved, offsets = {}, [0, 0]
    for key, parameter in _model().named_parameters():  # each place's rows of each parameter, in order
        pieces = []
        for place, vector in enumerate(vectors):
            count = files[place]["model"][key].numel()
            pieces.append(vector[offsets[place]:offsets[place] + count].reshape(files[place]["model"][key].shape))
            offsets[place] += count
        saved[key] = torch.cat(pieces)
    _cut(tmp_path)
    resumed = run_distributed(_resumed, world, BATCH, reader, str(tmp_path), True)  # nothing left to train
    assert "rows_made_up" not in resumed[0][1][0]  # (both merges were in the saved global model)
    for rank in range(world):  # every rank ends on the global model the services saved, bit for bit
        assert all(torch.equal(resumed[rank][0][key], saved[key]) for key in saved)


@pytest.mark.slow
def test_a_stop_to_one_rank_of_one_group_stops_every_rank_with_a_checkpoint_and_the_same_command_continues(tmp_path):
    # Rank 3 (of replica group 1) alone is signalled: its group partner stops with it at the same epoch end (they
    # step together: one rank gone would leave the other in a collective), and group 0 hears the stop from its
    # merge services. Without the group's agreement rank 2 waits on rank 3 until the timeout.
    args = ["train", *DIGITS, "--workers", "4", "--epochs", "30", "--strategy", "async", "--shard", "hybrid",
            "--shard-size", "2", "--timeout", "60", "--out", "run"]
    proc = ForkedDptrain(args, cwd=tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = sorted(int(child) for child in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split())
    assert len(workers) == 4
    os.kill(workers[3], signal.SIGTERM)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 75, stderr
    assert "Traceback" not in stderr and "PeerFailure" not in stderr, stderr
    assert stderr.count("[rank3] dptrain: rank 3: stopped by SIGTERM") == 1, stderr
    stopped_at = checkpoint_files.latest_complete(tmp_path / "run", 4)[0]
    assert stopped_at is not None and stopped_at < 30
    again = run_dptrain(args, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr
    # The checkpoint's writers are whole replica groups: all 4 ranks, or group 0 alone when group 1 stopped an epoch
    # earlier (its rows of that epoch are made up at the end). A checkpoint that named only the services' ranks
    # (0 and 2) as its writers was resumed as 2 workers onto 4: the ranks at place 1 from place 0's shards.
    line = next(each for each in again.stdout.splitlines() if "resuming after epoch" in each)
    assert f"resuming after epoch {stopped_at} from run" in line, again.stdout
    writers = line.split("job ranks ")[1].split(")")[0] if "written by" in line else "0, 1, 2, 3"
    assert writers in ("0, 1", "0, 1, 2, 3"), line
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(1, 31))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["strategy_options"]["replica_groups"] == 2 and summary["test_accuracy"] >= 0.85


@pytest.mark.parametrize("args,line", [
    (["--shard", "hybrid", "--shard-size", "2", "--strategy", "async", "--compression", "int8"],
     "--shard hybrid is refused with --compression int8"),
    (["--shard", "hybrid", "--shard-size", "2", "--strategy", "async", "--min-workers", "1"],
     "--shard hybrid with --min-workers (counted in replica groups) is refused with --strategy async "
     "(allreduce or sync only)"),
])
def test_what_sharded_async_refuses_is_one_line_before_anything_runs(tmp_path, args, line):
    refused_in_one_line(tmp_path, args, line)  # exit code 2, that one line on stderr, no traceback, nothing written
