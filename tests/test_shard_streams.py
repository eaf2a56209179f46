"""Sharded and streaming data (dptrain.data.streams): every sample read exactly once an epoch, over ranks and
loader workers, by the rule the module states; equal steps on every rank whatever the shard sizes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runner import run_dptrain
from stream_data import SIZES, offsets, read_record, write_parquets, write_tars

from dptrain.data import sharding
from dptrain.data.sampler import collate_items
from dptrain.data.streams import (Shard, ShardedStream, StreamReader, batch_sizes, rank_segments, shard_order,
                                  shuffled, worker_part)

HERE = Path(__file__).parent
N = sum(SIZES)


def ids_of(segments, sizes=SIZES) -> list[int]:
    starts = offsets(sizes)
    return [starts[shard] + i for shard, first, stop in segments for i in range(first, stop)]


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("epoch", [0, 1])
def test_ranks_cover_every_sample_once_with_sizes_within_one(world, epoch):
    order = shard_order(len(SIZES), epoch, seed=4, shuffle="global")
    parts = [ids_of(rank_segments(list(SIZES), order, rank, world)) for rank in range(world)]
    assert sorted(i for part in parts for i in part) == list(range(N))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    # the ranks read the epoch's shard order end to end: rank r's part follows rank r-1's
    assert [i for part in parts for i in part] == ids_of([(int(s), 0, SIZES[s]) for s in order])


def test_shard_order_is_a_permutation_drawn_per_epoch_and_file_order_without_shuffle():
    orders = [shard_order(7, epoch, seed=4, shuffle="global").tolist() for epoch in range(3)]
    assert all(sorted(order) == list(range(7)) for order in orders)
    assert len({tuple(order) for order in orders}) == 3
    assert shard_order(7, 5, seed=4, shuffle="none").tolist() == list(range(7))


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_loader_workers_split_a_rank_into_contiguous_parts_of_its_steps(workers):
    segments = rank_segments(list(SIZES), np.arange(7), 1, 2)  # positions 40..79
    sizes = batch_sizes(40, 6)
    parts = [worker_part(segments, sizes, role, workers) for role in range(workers)]
    assert [i for pieces, _ in parts for i in ids_of(pieces)] == list(range(40, 80))
    for role, (pieces, mine) in enumerate(parts):
        assert mine == [size for step, size in enumerate(sizes) if step % workers == role]
        assert len(ids_of(pieces)) == sum(mine)


def test_the_shuffle_buffer_gives_every_sample_once_in_an_order_of_the_seed():
    out = list(shuffled(range(100), 16, np.random.default_rng(3)))
    assert sorted(out) == list(range(100)) and out != list(range(100))
    assert out == list(shuffled(range(100), 16, np.random.default_rng(3)))
    assert list(shuffled(range(10), 16, None)) == list(range(10))


def _stream(shuffle="global") -> ShardedStream:
    starts = offsets()
    data = {f"s{k}": [(torch.tensor([float(starts[k] + i)]), 0) for i in range(size)] for k, size in enumerate(SIZES)}
    return ShardedStream([Shard(f"s{k}", size) for k, size in enumerate(SIZES)], lambda shard: iter(data[shard.name]),
                         "test shards", collate_items)


def _epoch(stream, workers, epoch, start=0) -> list[list[int]]:
    reader = StreamReader(stream, workers)
    reader.set_epoch(epoch, start)
    assert len(reader) == stream.steps - start
    return [x[:, 0].long().tolist() for x, _ in reader]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_read_by_loader_processes_gives_each_rank_its_part_in_equal_steps(workers):
    world, batch = 3, 4
    steps = sharding.steps_per_epoch(N, world, batch)
    read = []
    for rank in range(world):
        stream = _stream()
        assert stream.plan(rank, world, workers, batch, seed=5, shuffle="global") == steps
        batches = _epoch(stream, workers, epoch=1)
        assert len(batches) == steps and max(map(len, batches)) <= batch
        assert sorted(i for b in batches for i in b) == sorted(ids_of(stream.segments(1)))
        read += [i for b in batches for i in b]
    assert sorted(read) == list(range(N))


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_a_stream_started_within_an_epoch_gives_the_rest_of_the_same_batches(workers):
    stream = _stream()
    stream.plan(1, 2, workers, 4, seed=5, shuffle="global")
    whole = _epoch(stream, workers, epoch=0)
    for start in (1, 3, len(whole) - 1):
        assert _epoch(stream, workers, epoch=0, start=start) == whole[start:]


def _train(tmp_path, data, ranks, workers, *extra, record="record"):
    (tmp_path / record).mkdir()
    env = {**os.environ, "STREAM_RECORD": str(tmp_path / record),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return run_dptrain(["train", "--data", data, "--workers", ranks, "--loader-workers", workers, "--epochs", 2,
                        "--batch-size", 8, "--model", f"{HERE / 'stream_data.py'}:recording", "--no-progress",
                        "--device", "cpu", *extra], cwd=tmp_path, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("ranks, workers, kind", [(2, 0, "tar"), (2, 2, "parquet"), (3, 0, "parquet"),
                                                  (3, 2, "tar")])
def test_dptrain_train_reads_every_sample_exactly_once_an_epoch(tmp_path, ranks, workers, kind):
    data = write_tars(tmp_path / "shards") if kind == "tar" else write_parquets(tmp_path / "parquet")
    result = _train(tmp_path, data, ranks, workers)
    assert result.returncode == 0, result.stderr + result.stdout
    assert f"7 shards, {N} samples (3 to 20 a shard)" in result.stdout
    record = read_record(tmp_path / "record", ranks)
    steps = sharding.steps_per_epoch(N, ranks, 8)
    assert [len(batches) for batches in record] == [2 * steps] * ranks  # the same steps on every rank
    for epoch in (0, 1):
        read = [i for batches in record for batch in batches[epoch * steps:(epoch + 1) * steps] for i in batch]
        assert sorted(read) == list(range(N)), f"epoch {epoch}"
        for rank, batches in enumerate(record):  # each rank read the part the rule gives it
            order = shard_order(len(SIZES), epoch, seed=0, shuffle="global")
            mine = [i for batch in batches[epoch * steps:(epoch + 1) * steps] for i in batch]
            assert sorted(mine) == sorted(ids_of(rank_segments(list(SIZES), order, rank, ranks)))
    first = [sorted(i for batch in record[0][:steps] for i in batch)]
    assert first != [sorted(i for batch in record[0][steps:] for i in batch)]  # shards drawn anew each epoch


@pytest.mark.slow
@pytest.mark.parametrize("strategy, ranks, sharded", [
    ("sync", 2, ()), ("async", 2, ()), ("streaming", 2, ()),
    # 2 replica groups of 2 ranks, each group's model sharded (FSDP2), merged into one service per place: the rows
    # are shared out over the groups, and each step's rows of a group over its ranks
    ("async", 4, ("--shard", "hybrid", "--shard-size", "2", "--batch-size", "4"))])
def test_the_strategies_that_share_the_data_read_each_sample_once_from_shards(tmp_path, strategy, ranks, sharded):
    data = write_tars(tmp_path / "shards")
    result = _train(tmp_path, data, ranks, 0, "--epochs", 1, "--strategy", strategy, *sharded)
    assert result.returncode == 0, result.stderr + result.stdout
    record = read_record(tmp_path / "record", ranks)
    assert all(record)  # every rank read rows
    assert sorted(i for batches in record for batch in batches for i in batch) == list(range(N))


@pytest.mark.slow
def test_a_worker_slowed_with_slow_worker_times_its_compute_on_the_first_samples_of_the_shards(tmp_path):
    """--slow-worker times a rank's own steps on its first batches: an IterableDataset has no rows to index, so
    they are the shards' first samples in file order (this crashed with a DataLoader traceback)."""
    result = _train(tmp_path, write_tars(tmp_path / "shards"), 2, 0, "--epochs", 1, "--slow-worker", "1:2")
    assert result.returncode == 0, result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    assert "dptrain: rank 1: --slow-worker 2: its own compute is " in result.stderr


@pytest.mark.slow
def test_fedavg_over_shards_is_refused_in_one_line(tmp_path):
    stderr = _refused(tmp_path, write_tars(tmp_path / "shards"), "--strategy", "fedavg")
    assert "--strategy fedavg keeps its own partitions of map-style data, and shards are read as a stream" in stderr


@pytest.mark.slow
@pytest.mark.parametrize("factory", ["iterable", "hugging_face_iterable", "hugging_face", "webdataset_pipeline"])
def test_a_factory_returning_iterable_or_hugging_face_data_reads_each_sample_once(tmp_path, factory):
    write_tars(tmp_path / "shards")
    result = _train(tmp_path, f"{HERE / 'stream_data.py'}:{factory}", 2, 2, "--epochs", 1)
    assert result.returncode == 0, result.stderr + result.stdout
    record = read_record(tmp_path / "record", 2)
    read = sorted(i for batches in record for batch in batches for i in batch)
    if factory == "hugging_face":  # map-style: the usual sampler, 20 % held out for testing
        assert len(read) == len(set(read)) == N - 16
    else:
        assert read == list(range(N))
        assert len(record[0]) == len(record[1]) == sharding.steps_per_epoch(N, 2, 8)


def test_fit_reads_an_iterable_dataset_given_to_it_as_a_stream(tmp_path, monkeypatch):
    from stream_data import Counting, recording

    from dptrain import Trainer

    monkeypatch.setenv("STREAM_RECORD", str(tmp_path))
    model = recording((4,), 3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), batch_size=8, progress=False,
                      verbose=False)
    trainer.fit(Counting(), epochs=2)
    batches = read_record(tmp_path, 1)[0]
    assert len(batches) == 2 * 10
    assert [sorted(i for b in batches[e * 10:(e + 1) * 10] for i in b) for e in (0, 1)] == [list(range(N))] * 2


@pytest.mark.parametrize("strategy, keywords, line", [
    ("Auto", {}, "--strategy auto times map-style batches; with shards name the strategy (e.g. allreduce)"),
    ("Async", {"min_workers": 1}, "--min-workers 1 with --strategy async: its workers share the data out again "
                                  "from an epoch each reaches on its own, and shards read as a stream are shared out at "
                                  "an epoch all workers stand at; use sync, streaming, hierarchical or allreduce, or "
                                  "drop --min-workers"),
])
def test_fit_refuses_a_stream_where_dptrain_train_does(strategy, keywords, line, tmp_path, monkeypatch):
    from stream_data import Counting, recording

    import dptrain
    from dptrain.errors import UserError

    monkeypatch.setenv("STREAM_RECORD", str(tmp_path))
    model = recording((4,), 3)
    trainer = dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                              strategy=getattr(dptrain, strategy)(), batch_size=8, progress=False, verbose=False, **keywords)
    with pytest.raises(UserError) as refused:
        trainer.fit(Counting(), epochs=1)
    assert str(refused.value) == line


# -- bad data: one line, exit 2, nothing on disk changed ------------------------------------------------------
def _snapshot(folder: Path) -> dict:
    return {str(path.relative_to(folder)): (path.read_bytes() if path.is_file() else b"")
            for path in sorted(folder.rglob("*"))}


def _refused(tmp_path, data, *extra, ranks=2) -> str:
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "out" / "note.txt").write_text("kept")
    before = _snapshot(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    result = run_dptrain(["train", "--data", data, "--workers", ranks, "--epochs", 1, "--batch-size", 8,
                          "--no-progress", "--device", "cpu", "--out", "out/run", *extra], cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() and line.strip()]
    assert len(errors) >= 1
    after = _snapshot(tmp_path)
    assert {name: data for name, data in after.items() if not name.startswith("out/run")} == before
    return result.stderr


def test_a_shard_pattern_matching_nothing_is_refused(tmp_path):
    stderr = _refused(tmp_path, "shards/train-{000000..000009}.tar")
    assert ("--data 'shards/train-{000000..000009}.tar' matches no files (in " in stderr
            and "give a pattern of existing shards" in stderr)
    assert not (tmp_path / "out" / "run").exists()


def test_a_truncated_tar_shard_is_named_with_the_sample_where_it_breaks(tmp_path):
    data = write_tars(tmp_path / "shards")
    shard = tmp_path / "shards" / "train-000003.tar"
    shard.write_bytes(shard.read_bytes()[:2 * 4096 + 700])  # samples of 4 KB (two members): cut in the third
    stderr = _refused(tmp_path, data)
    assert "shard 'shards/train-000003.tar' is not a readable tar file (corrupt or truncated at sample 2)" in stderr


def test_a_corrupt_tar_shard_is_named(tmp_path):
    data = write_tars(tmp_path / "shards")
    shard = tmp_path / "shards" / "train-000001.tar"
    shard.write_bytes(b"\x07" * 4096)
    stderr = _refused(tmp_path, data)
    assert "shard 'shards/train-000001.tar' is not a readable tar file (corrupt or truncated at sample 0)" in stderr


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_bad_parquet_file_is_named(tmp_path, damage):
    data = write_parquets(tmp_path / "parquet")
    shard = tmp_path / "parquet" / "part-002.parquet"
    shard.write_bytes(shard.read_bytes()[:200] if damage == "truncated" else b"PAR1" + b"\x00" * 300)
    stderr = _refused(tmp_path, data)
    assert "shard 'parquet/part-002.parquet' is not a readable Parquet file (corrupt or truncated)" in stderr


def test_an_iterable_dataset_yielding_nothing_is_refused(tmp_path):
    stderr = _refused(tmp_path, f"{HERE / 'stream_data.py'}:empty")
    assert "the iterable dataset yielded no samples; it must yield (x, y) pairs" in stderr


@pytest.mark.slow
def test_an_iterable_dataset_yielding_nothing_on_one_rank_stops_the_run_in_one_line(tmp_path):
    stderr = _refused(tmp_path, f"{HERE / 'stream_data.py'}:empty_on_rank1")
    assert "[rank1]" in stderr and "the iterable dataset yielded no samples" in stderr


@pytest.mark.slow
def test_ranks_that_count_different_samples_are_refused_before_any_step(tmp_path):
    stderr = _refused(tmp_path, f"{HERE / 'stream_data.py'}:shorter_on_rank1")
    assert "the ranks see different data (samples rank 0: 80, rank 1: 70)" in stderr


def test_a_hugging_face_dataset_without_the_columns_is_refused(tmp_path):
    stderr = _refused(tmp_path, f"{HERE / 'stream_data.py'}:hugging_face_other_columns")
    assert ("the Hugging Face dataset has the columns pixels, target; dptrain reads an input and a label column: "
            "x and y, image and label") in stderr


# -- exact resume of a stream ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_killed_mid_epoch_and_resumed_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path, workers):
    from test_train_cli import same_model

    data = write_tars(tmp_path / "shards")
    args = ["train", "--data", data, "--workers", 2, "--loader-workers", workers, "--epochs", 2, "--batch-size", 8,
            "--model", "mlp", "--lr", "0.05", "--no-progress", "--device", "cpu"]
    clean = run_dptrain([*args, "--out", "clean"], cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr
    # 5 steps an epoch: rank 1 dies after step 9 (the 4th of epoch 2), before that step's checkpoint
    killed = run_dptrain([*args, "--checkpoint-every-steps", 2, "--max-restarts", 1, "--out", "killed"],
                         cwd=tmp_path, env={**os.environ, "DPTRAIN_FAULT": "step@1:9",
                                            "DPTRAIN_FAULT_ONCE": str(tmp_path / "fired")})
    assert killed.returncode == 0, killed.stderr
    assert "worker rank 1 was killed by SIGKILL" in killed.stderr
    assert "resuming at step 2 of epoch 2 from" in killed.stdout
    assert same_model(tmp_path / "clean", tmp_path / "killed")


# -- --stage-to DIR ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_shards_staged_to_a_local_folder_train_the_same_and_a_resume_copies_nothing(tmp_path):
    from test_train_cli import same_model

    data = write_tars(tmp_path / "shards")
    args = ["train", "--data", data, "--workers", 2, "--epochs", 1, "--batch-size", 8, "--model", "mlp",
            "--no-progress", "--device", "cpu"]
    plain = run_dptrain([*args, "--out", "plain"], cwd=tmp_path)
    staged = run_dptrain([*args, "--stage-to", "local", "--epochs", 1, "--out", "staged"], cwd=tmp_path)
    assert plain.returncode == 0 and staged.returncode == 0, staged.stderr
    total = sum((tmp_path / "shards" / f"train-{k:06d}.tar").stat().st_size for k in range(len(SIZES)))
    assert f"--stage-to local: copied 7 shards ({total:,} bytes) in " in staged.stdout
    assert sorted(p.name for p in (tmp_path / "local").glob("*.tar")) == [f"train-{k:06d}.tar" for k in range(7)]
    assert same_model(tmp_path / "plain", tmp_path / "staged")
    again = run_dptrain([*args, "--stage-to", "local", "--epochs", 2, "--resume", "--out", "staged"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "--stage-to local: copied 0 shards (0 bytes) in " in again.stdout and "; 7 already there" in again.stdout


def test_stage_to_applies_to_shards_only(tmp_path):
    np.savez(tmp_path / "tiny.npz", x=np.zeros((20, 3), np.float32), y=np.arange(20) % 2)
    result = run_dptrain(["train", "--data", "tiny.npz", "--stage-to", "local", "--workers", 1], cwd=tmp_path)
    assert result.returncode == 2 and "--stage-to" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "local").exists()


@pytest.mark.slow
def test_a_run_on_shards_is_not_continued_on_other_shards(tmp_path):
    data = write_tars(tmp_path / "shards")
    args = ["train", "--data", data, "--workers", 2, "--batch-size", 8, "--model", "mlp", "--no-progress",
            "--device", "cpu", "--out", "run"]
    first = run_dptrain([*args, "--epochs", 1], cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    write_tars(tmp_path / "shards", sizes=(5, 17, 9, 12, 3, 20, 15))  # one sample more in the last shard
    again = run_dptrain([*args, "--epochs", 2], cwd=tmp_path)
    assert again.returncode == 2, again.stdout + again.stderr
    assert "80 training rows then, 81 now" in again.stderr and "Traceback" not in again.stderr
