"""--stage-to DIR copies the shards in the background (dptrain.data.staging): training starts before the copy
ends, reads every sample once an epoch while it runs and ends with the same weights; a resume reads the copies
and copies nothing; a copy that fails or is cut short is never read, and the lock keeps two copying processes apart."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_runner import run_dptrain
from stream_data import SIZES, read_record, write_tars
from staging_watch import read_staged

from dptrain.data import sharding, staging
from dptrain.data.shard_files import open_shards
from dptrain.data.streams import StreamReader, copy_order, rank_segments, shard_order

HERE = Path(__file__).parent
N = sum(SIZES)
STEPS = sharding.steps_per_epoch(N, 2, 8)  # 5 steps an epoch on each of 2 ranks


def _train(tmp_path: Path, out: str, epochs: int, *extra, env: dict = ()):
    (tmp_path / f"record-{out}").mkdir(exist_ok=True)
    env = {**os.environ, "STREAM_RECORD": str(tmp_path / f"record-{out}"), "STAGE_WATCH": str(tmp_path / "local"),
           **dict(env)}
    return run_dptrain(["train", "--data", "shards/train-{000000..000006}.tar", "--workers", 2, "--epochs", epochs,
                        "--batch-size", 8, "--model", f"{HERE / 'staging_watch.py'}:watching", "--no-progress",
                        "--device", "cpu", "--out", out, *extra], cwd=tmp_path, env=env)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Shards and an unstaged 3-epoch run over them, the weights the staged runs must end with."""
    root = tmp_path_factory.mktemp("staging")
    write_tars(root / "shards")
    result = _train(root, "plain", 3)
    assert result.returncode == 0, result.stderr
    return root


def _each_epoch_reads_every_sample_once(record: list[list[list[int]]], epochs) -> None:
    for epoch in epochs:
        read = [i for batches in record for batch in batches[epoch * STEPS:(epoch + 1) * STEPS] for i in batch]
        assert sorted(read) == list(range(N)), f"epoch {epoch}"


@pytest.mark.slow
def test_training_starts_before_the_copy_ends_and_a_resume_reads_the_copies(plain):
    from test_train_cli import same_model

    write_tars(plain / "shards")  # (as the fixture wrote them: the other test may have spoiled them)
    shards = plain / "shards"
    sources = [shards / f"train-{k:06d}.tar" for k in range(len(SIZES))]
    # each shard's copy takes 0.2 s longer: 1.4 s for the 7, against 10 steps of 0.25 s
    staged = _train(plain, "staged", 2, "--stage-to", "local",
                    env={staging.SLOW: "0.2", "STREAM_STEP_SECONDS": "0.25"})
    assert staged.returncode == 0, staged.stderr
    for rank in (0, 1):  # the first step of each rank was taken before the last shard was complete in DIR
        steps = read_staged(plain / "record-staged", rank)
        assert len(steps) == 2 * STEPS and steps[0] < len(SIZES) and steps[-1] == len(SIZES)
    _each_epoch_reads_every_sample_once(read_record(plain / "record-staged", 2), (0, 1))
    total = sum(path.stat().st_size for path in sources)
    assert staged.stdout.count("--stage-to local: copied") == 1  # one copier on the node: local rank 0
    assert f"--stage-to local: copied 7 shards ({total:,} bytes) in " in staged.stdout
    assert sorted(p.name for p in (plain / "local").iterdir()) == [".dptrain-stage.lock", *(p.name for p in sources)]
    import json
    record = json.loads((plain / "staged" / "summary.json").read_text())["data"]["staging"]
    assert {key: record[key] for key in ("copied", "bytes", "already_there", "finished")} == \
        {"copied": 7, "bytes": total, "already_there": 0, "finished": True}

    # the originals spoiled (zeros of the same size and time): a resume that read one would fail
    for path in sources:
        times = path.stat()
        path.write_bytes(bytes(times.st_size))
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
    again = _train(plain, "staged", 3, "--stage-to", "local", "--resume", env={staging.SLOW: "0.2"})
    assert again.returncode == 0, again.stderr
    assert "--stage-to local: copied 0 shards (0 bytes) in " in again.stdout and "; 7 already there" in again.stdout
    _each_epoch_reads_every_sample_once(read_record(plain / "record-staged", 2), (0, 1, 2))
    assert same_model(plain / "plain", plain / "staged")


@pytest.mark.slow
def test_a_stage_folder_that_cannot_be_made_is_one_warning_and_the_run_the_same(plain):
    from test_train_cli import same_model

    write_tars(plain / "shards")  # (as the fixture wrote them: the other test may have spoiled them)
    (plain / "blocker").write_text("a file, so no folder can be made under it")
    result = _train(plain, "unstaged", 3, "--stage-to", "blocker/local")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "warning: --stage-to" in line]
    assert len(warnings) == 1 and "blocker/local cannot be used: " in warnings[0], result.stdout
    assert "the shards are read from where they are" in warnings[0]
    assert same_model(plain / "plain", plain / "unstaged")


# -- in one process ----------------------------------------------------------------------------------------------
def _epoch_ids(stream) -> list[int]:
    reader = StreamReader(stream, 0)
    reader.set_epoch(0)
    return [int(i) for x, _ in reader for i in x[:, 0]]


def test_the_copy_follows_the_nodes_reading_order():
    counts = list(SIZES)
    order = copy_order(counts, 0, 3, "global", range(2), 2)
    firsts = [[shard for shard, _, _ in rank_segments(counts, shard_order(7, 0, 3, "global"), rank, 2)]
              for rank in (0, 1)]
    assert sorted(order) == list(range(7))
    assert order[:2] == [firsts[0][0], firsts[1][0]]  # each rank's first shard first
    assert copy_order(counts, 0, 3, "none", range(1), 1) == list(range(7))


def test_two_processes_staging_one_folder_at_once_copy_each_shard_once(tmp_path):
    data = write_tars(tmp_path / "shards")
    paths = [shard.name for shard in open_shards(str(tmp_path / data)).shards]
    env = {key: value for key, value in os.environ.items() if key != "LOCAL_RANK"}  # both "the first of the node"
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent / "src"), env.get("PYTHONPATH")])),
               **{staging.SLOW: "0.05"})  # 7 copies of at least 0.05 s: the two processes meet at DIR's lock
    log, go = tmp_path / "copies.log", tmp_path / "GO"
    copiers = [subprocess.Popen([sys.executable, str(HERE / "staging_copier.py"), "local", str(log), str(go), *paths],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("READY-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        go.touch()
        said = [copier.communicate(timeout=60) for copier in copiers]
    finally:
        for copier in copiers:
            copier.kill()
    assert [copier.returncode for copier in copiers] == [0, 0], said
    results = [json.loads(out.splitlines()[-1]) for out, _ in said]
    copies = [line.split() for line in log.read_text().splitlines()]
    assert sorted(source for _, source, _ in copies) == sorted(paths)  # 7 copies in all, none twice
    assert len({pid for pid, _, _ in copies}) == 1  # all by the process that took DIR's lock first
    assert max(result["began"] for result in results) < max(float(end) for _, _, end in copies)  # at once
    assert sorted((r["record"]["copied"], r["record"]["already_there"]) for r in results) == [(0, 7), (7, 0)]
    assert all(result["record"]["finished"] for result in results)
    assert [result["usable"] for result in results] == [[True] * 7, [True] * 7]  # each reads all 7 from DIR
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == \
        [".dptrain-stage.lock", *sorted(os.path.basename(path) for path in paths)]  # no partial file


def test_a_failed_copy_is_one_warning_and_the_rest_is_read_from_the_originals(tmp_path, monkeypatch, capsys):
    data = write_tars(tmp_path / "shards")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    whole = open_shards(data)
    whole.plan(0, 1, 0, 8, 0, "global")
    expected = _epoch_ids(whole)
    real, calls = staging._copy_file, []

    def full_after_two(source, partial, stop):
        calls.append(source)
        if len(calls) == 3:  # the third copy fills the disk half way
            Path(partial).write_bytes(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(source, partial, stop)

    monkeypatch.setattr(staging, "_copy_file", full_after_two)
    stream = open_shards(data, stage_to="local")
    stream.plan(0, 1, 0, 8, 0, "global")
    assert _epoch_ids(stream) == expected  # the same samples in the same order, whatever is staged
    assert stream.staging.wait(30)
    out = capsys.readouterr().out
    assert out.count("warning") == 1 and f"copying '{calls[2]}' failed: {os.strerror(errno.ENOSPC)}" in out
    assert stream.staging.record["copied"] == 2 and not stream.staging.record["finished"]
    assert sorted(p.name for p in Path("local").iterdir()) == sorted(
        [".dptrain-stage.lock", *(os.path.basename(path) for path in calls[:2])])  # no partial file left
    assert [stream.staging.where(path) != path for path in calls] == [True, True, False]
    assert _epoch_ids(stream) == expected


def test_a_copy_cut_short_by_the_runs_end_is_removed_and_never_read(tmp_path, monkeypatch, capsys):
    data = write_tars(tmp_path / "shards")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    began, release = threading.Event(), threading.Event()
    real = staging._copy_file

    def held(source, partial, stop):
        if began.is_set():  # the second copy: half written when the run ends
            Path(partial).write_bytes(b"half")
            release.set()
            stop.wait(30)
            raise staging._Stopped
        began.set()
        real(source, partial, stop)

    monkeypatch.setattr(staging, "_copy_file", held)
    stream = open_shards(data, stage_to="local")
    stream.plan(0, 1, 0, 8, 0, "global")
    stream.set_epoch(0)
    assert release.wait(30)
    stream.staging.stop()
    assert stream.staging.wait(1)
    assert "the run ended with 1 of the 7 shards to copy copied" in capsys.readouterr().out
    assert [p.name for p in Path("local").iterdir() if "partial" in p.name] == []
    assert sum(stream.staging.where(path) != path for path in (shard.name for shard in stream.shards)) == 1
