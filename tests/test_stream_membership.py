"""Shards read as a stream under live membership (--min-workers): after a worker is lost (or leaves at an epoch
end) the stream is planned again over the workers left, from the epoch's start or from allreduce's commit with
the rest of the epoch's samples shared out, each unread sample read once (dptrain.data.streams: StreamRest)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_dptrain
from stream_data import SIZES, offsets, read_record, write_tars
from test_shard_streams import _stream

from dptrain.data import sharding
from dptrain.data.streams import StreamReader, StreamRest, position_pieces, rank_segments, shard_order

HERE = Path(__file__).parent
N = sum(SIZES)


# -- the rest of an epoch (pure, in one process) ---------------------------------------------------------------
def test_positions_become_pieces_one_a_run_within_a_shard():
    order = np.array([2, 0, 1])  # shards of 3, 4 and 5 samples laid end to end as 5 + 3 + 4
    assert position_pieces([3, 4, 5], order, np.array([0, 1, 2, 4, 5, 6, 7, 11])) == [
        (2, 0, 3), (2, 4, 5), (0, 0, 3), (1, 3, 4)]
    assert position_pieces([3, 4, 5], order, np.arange(12)) == [(2, 0, 5), (0, 0, 3), (1, 0, 4)]
    assert position_pieces([3, 4, 5], order, np.array([], dtype=np.int64)) == []


def _read(rank, world, workers, epoch, shuffle, start=0, rest=None) -> list[list[int]]:
    stream = _stream()
    stream.plan(rank, world, workers, 4, 5, shuffle, rest)
    reader = StreamReader(stream, workers)
    reader.set_epoch(epoch, start)
    batches = [x[:, 0].long().tolist() for x, _ in reader]
    assert len(batches) == len(reader)
    return batches


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", ["global", "none"])
def test_the_rest_after_a_commit_reads_every_sample_no_rank_had_read_once_even_after_a_second_change(workers,
                                                                                                     shuffle):
    # 3 ranks read 3 steps of epoch 1; ranks 0 and 2 of the job go on with the rest (1 step), then rank 0 alone
    read = [i for rank in range(3) for batch in _read(rank, 3, workers, 1, shuffle)[:3] for i in batch]
    rest = StreamRest.whole_stream(1, N, (0, 1, 2), 4, workers, 5, shuffle).after(3, (0, 2), 4)
    assert rest.read_by((0, 1, 2)) == len(read) and rest.steps == sharding.steps_per_epoch(N - len(read), 2, 4)
    read += [i for place in range(2) for batch in _read(place, 2, workers, 1, shuffle, 3, rest)[:1] for i in batch]
    last = rest.after(4, (0,), 4)
    read += [i for batch in _read(0, 1, workers, 1, shuffle, 4, last) for i in batch]
    assert sorted(read) == list(range(N))
    assert last.read_by((1,)) == rest.read_by((1,)) == 12  # rank 1 of the job, lost at the first change


# -- over real processes --------------------------------------------------------------------------------------
def _train(tmp_path, strategy, *extra, epochs=2, action="kill"):
    """A run of `strategy` over the shards, 3 workers, --min-workers 2, rank 1's fault halfway through epoch 2
    (`action`: DPTRAIN_FAULT_ACTION): (the process, metrics.jsonl's records, each rank's batches)."""
    data = write_tars(tmp_path / "shards")
    (tmp_path / "record").mkdir()
    env = {**os.environ, "STREAM_RECORD": str(tmp_path / "record"), "DPTRAIN_FAULT": "train-middle@1:2",
           "DPTRAIN_FAULT_ONCE": str(tmp_path / "fired"), "DPTRAIN_FAULT_ACTION": action,
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    result = run_dptrain(["train", "--data", data, "--workers", 3, "--min-workers", 2, "--strategy", strategy,
                          "--epochs", epochs, "--model", f"{HERE / 'stream_data.py'}:recording", "--no-progress",
                          "--device", "cpu", "--out", "run", *extra], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr + result.stdout
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return result, history, read_record(tmp_path / "record", 3)


def _killed(tmp_path, strategy, *extra):
    result, history, record = _train(tmp_path, strategy, *extra)
    assert "dptrain: worker rank 1 was killed by SIGKILL; the others go on without it" in result.stderr
    assert [[worker["rank"] for worker in record["workers"]] for record in history] == [[0, 1, 2], [0, 1]]
    assert history[1]["membership"]["members"] == [0, 2]
    return result, history, record


def _rule(epoch, place, world) -> list[int]:
    """The samples of `epoch` the rule gives rank `place` of `world`."""
    order, starts = shard_order(len(SIZES), epoch, seed=0, shuffle="global"), offsets()
    return sorted(starts[shard] + i for shard, first, stop in rank_segments(list(SIZES), order, place, world)
                  for i in range(first, stop))


def _tail(batches, samples) -> list[int]:
    """The last batches of a rank's record that hold `samples` samples: what it read after the change."""
    taken: list[int] = []
    for batch in reversed(batches):
        if len(taken) >= samples:
            break
        taken = batch + taken
    assert len(taken) == samples
    return taken


def _assert_epoch_1_by_three(record, batch):
    steps = sharding.steps_per_epoch(N, 3, batch)
    assert sorted(i for batches in record for b in batches[:steps] for i in b) == list(range(N))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sync", "allreduce"])
def test_a_worker_lost_mid_epoch_is_redone_by_the_others_over_the_shards_each_sample_once(tmp_path, strategy):
    result, history, record = _killed(tmp_path, strategy, "--batch-size", 8)
    assert "continuing from epoch 2 with 2 workers (ranks 0, 2 of the job; without rank 1)" in result.stdout
    _assert_epoch_1_by_three(record, 8)
    # epoch 2, redone from its start by ranks 0 and 2 of the job (0 and 1 of the new group): each the rule's part
    for place, rank in enumerate((0, 2)):
        assert sorted(_tail(record[rank], N // 2)) == _rule(1, place, 2)
    assert sorted(_tail(record[0], 40) + _tail(record[2], 40)) == list(range(N))
    assert [worker["samples"] for worker in history[1]["workers"]] == [40, 40]


@pytest.mark.slow
def test_a_worker_leaving_at_an_epoch_end_leaves_the_next_epochs_shards_to_the_others_by_the_rule(tmp_path):
    result, history, record = _train(tmp_path, "sync", "--batch-size", 8, epochs=3, action="stop")
    assert "rank 1 left after epoch 2 on request (SIGUSR1); continuing with 2 workers (ranks 0, 2 of the job)" in (
        result.stdout + result.stderr)
    assert [[worker["rank"] for worker in record["workers"]] for record in history] == [[0, 1, 2]] * 2 + [[0, 1]]
    assert history[2]["membership"]["members"] == [0, 2]
    steps = sharding.steps_per_epoch(N, 3, 8)
    for epoch in (0, 1):
        assert sorted(i for batches in record for b in batches[epoch * steps:(epoch + 1) * steps] for i in b) == (
            list(range(N)))
    assert len(record[1]) == 2 * steps and len(record[0]) == len(record[2]) == 2 * steps + sharding.steps_per_epoch(
        N, 2, 8)
    for place, rank in enumerate((0, 2)):
        assert sorted(i for b in record[rank][2 * steps:] for i in b) == _rule(2, place, 2)


@pytest.mark.slow
def test_allreduce_goes_on_from_a_commit_with_the_unread_samples_of_the_shards_shared_over_the_others(tmp_path):
    # batch 4: 7 steps an epoch on 3 workers; rank 1 is killed before its 4th step of epoch 2, the others go on
    # from their commit at step 2 with what no rank had read by then (the shuffle buffer's draws replayed)
    result, history, record = _killed(tmp_path, "allreduce", "--batch-size", 4, "--commit-every-steps", 2)
    change = history[1]["membership"]
    assert change["continued_from_step"] == 2, change
    assert "continuing from epoch 2 at step 2 of it (its last commit" in result.stdout
    _assert_epoch_1_by_three(record, 4)
    steps = sharding.steps_per_epoch(N, 3, 4)
    before = [record[rank][steps:steps + 2] for rank in range(3)]  # the 2 steps of epoch 2 every rank kept
    assert change["rows_read_by_the_lost"] == sum(map(len, before[1]))
    read = [i for batches in before for batch in batches for i in batch]
    for worker, rank in zip(history[1]["workers"], (0, 2)):
        read += _tail(record[rank], worker["samples"] - sum(map(len, before[rank])))
    assert sorted(read) == list(range(N))


def test_async_with_min_workers_over_shards_is_refused_in_one_line(tmp_path):
    data = write_tars(tmp_path / "shards")
    result = run_dptrain(["train", "--data", data, "--workers", 2, "--min-workers", 2, "--strategy", "async",
                          "--epochs", 1, "--batch-size", 8, "--no-progress", "--device", "cpu", "--out", "run"],
                         cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert ("--min-workers 2 with --strategy async: its workers share the data out again from an epoch each reaches "
            "on its own, and shards read as a stream are shared out at an epoch all workers stand at; use sync, "
            "streaming, hierarchical or allreduce, or drop --min-workers") in result.stderr
    assert not (tmp_path / "run").exists()


EPOCHS = 60  # of 0.2 to 0.25 s: the new worker enters after its start-up, a few seconds


@pytest.mark.slow
def test_a_worker_joining_in_place_of_a_lost_one_reads_its_part_of_the_shards_from_the_epoch_it_enters(tmp_path):
    data = write_tars(tmp_path / "shards")
    (tmp_path / "record").mkdir()
    env = {**os.environ, "STREAM_RECORD": str(tmp_path / "record"), "DPTRAIN_FAULT": "train-middle@1:2",
           "STREAM_STEP_SECONDS": "0.05", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    result = run_dptrain(["train", "--data", data, "--workers", "2:3", "--strategy", "sync", "--epochs", EPOCHS,
                          "--batch-size", 8, "--model", f"{HERE / 'stream_data.py'}:recording", "--no-progress",
                          "--device", "cpu", "--out", "run"], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "dptrain: starting worker rank 3 in place of rank 1" in result.stderr
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    worlds = [len(record["workers"]) for record in history]
    first = next(i for i, record in enumerate(history) if record.get("membership", {}).get("joined"))
    assert history[first]["membership"]["members"] == [0, 2, 3] and worlds == [3] + [2] * (first - 1) + [3] * (
        EPOCHS - first)
    record = read_record(tmp_path / "record", 4)
    steps = {world: sharding.steps_per_epoch(N, world, 8) for world in (2, 3)}
    after = [sum(steps[world] for world in worlds[epoch:]) for epoch in range(EPOCHS + 1)]  # lines from epoch e on
    assert len(record[3]) == after[first]  # the joiner reads from the epoch it entered at on
    members = {epoch: ((0, 2) if worlds[epoch] == 2 else (0, 2, 3)) for epoch in range(1, EPOCHS)}
    for epoch in range(1, EPOCHS):  # epoch 2 (index 1) as redone by the survivors, the others as run
        lines = {rank: record[rank][len(record[rank]) - after[epoch]:][:steps[worlds[epoch]]] for rank in members[epoch]}
        for place, rank in enumerate(members[epoch]):
            assert sorted(i for batch in lines[rank] for i in batch) == _rule(epoch, place, worlds[epoch]), epoch


@pytest.mark.slow
def test_a_checkpoint_within_an_epoch_of_shards_is_not_resumed_on_another_number_of_workers(tmp_path):
    data = write_tars(tmp_path / "shards")
    argv = ["train", "--data", data, "--epochs", 2, "--batch-size", 8, "--model", "mlp", "--no-progress",
            "--device", "cpu", "--out", "run", "--checkpoint-every-steps", 2]
    # 5 steps an epoch on 2 workers: killed after step 9, the newest checkpoint is step 4 of epoch 2
    killed = run_dptrain([*argv, "--workers", 2], cwd=tmp_path, env={**os.environ, "DPTRAIN_FAULT": "step@0,1:9"})
    assert killed.returncode != 0
    again = run_dptrain([*argv, "--workers", 3, "--resume"], cwd=tmp_path)
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    assert ("this checkpoint within an epoch was written by another number of workers, and shards read as a stream "
            "go on within an epoch only on the same number; resume with as many workers") in again.stderr
