"""A checkpoint belongs to one run and one data set: its manifest names the run's id and the training data's
fingerprint, and a checkpoint of another run, or data changed since, is refused in one line (exit 2, nothing on
disk touched); --resume-with-changed-data goes on with the data as it is now. --keep-checkpoints K leaves K."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from dptrain.data.fingerprint import difference, fingerprint, sampled_rows
from dptrain.data.sampler import as_dataset
from dptrain.train import checkpoint_files
from dptrain.train.rundir import run_id
from test_train_cli import dptrain

BASE = ["train", "--model", "mlp", "--batch-size", "32", "--lr", "0.05", "--no-progress", "--workers", "2"]
CRASH = {"DPTRAIN_FAULT": "save-begin@0:2"}  # rank 0 killed as it begins epoch 2's checkpoint: epoch 1's is the newest


def snapshot(run: Path) -> dict:
    return {str(path): (path.stat().st_mtime_ns, path.stat().st_size) for path in sorted(run.rglob("*"))}


def crashed(tmp_path: Path, argv: list[str], name: str) -> Path:
    """A run of `argv` into `name` whose every worker was gone after its epoch-1 checkpoint."""
    env = {**CRASH, "DPTRAIN_FAULT_ONCE": str(tmp_path / f"{name}.fired")}
    assert dptrain(*argv, "--out", name, cwd=tmp_path, env=env).returncode != 0
    assert checkpoint_files.latest_complete(tmp_path / name, 2)[0] == 1
    return tmp_path / name


def test_the_fingerprint_tells_a_permutation_and_another_row_count_from_the_same_rows():
    x, y = np.arange(2000 * 3, dtype=np.float32).reshape(2000, 3), np.arange(2000) % 10
    same = fingerprint(as_dataset((x.copy(), y.copy())))
    assert fingerprint(as_dataset((x, y))) == same == {"rows": 2000, "sha256": same["sha256"]}
    order = np.random.default_rng(0).permutation(2000)
    assert difference(same, fingerprint(as_dataset((x[order], y[order])))) == (
        "the same 2,000 training rows in number, but other rows or in another order")
    assert difference(same, fingerprint(as_dataset((x[:1500], y[:1500])))) == "2,000 training rows then, 1,500 now"
    rows = sampled_rows(2000)
    assert rows[0] == 0 and rows[-1] == 1999 and len(rows) == 64  # a few rows read, however large the file


def test_a_checkpoint_is_complete_when_every_member_its_manifest_names_wrote_its_file(tmp_path):
    for epoch in (1, 2):
        checkpoint_files.write_manifest(tmp_path, epoch, (0, 2), "sync", "abc", None)
        checkpoint_files.save(tmp_path, epoch, 0, {"epoch": epoch})
    checkpoint_files.save(tmp_path, 1, 2, {"epoch": 1})
    # whatever world the next run has, epoch 2 lacks job rank 2's file and epoch 1 is the newest complete one
    for world in (2, 3):
        assert checkpoint_files.latest_complete(tmp_path, world) == (1, [
            "the checkpoint of epoch 2 was not finished; continuing from epoch 1"])
    checkpoint_files.prune(tmp_path, 1, 3)
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["epoch-000001", "epoch-000002"]
    checkpoint_files.save(tmp_path, 2, 2, {"epoch": 2})
    checkpoint_files.prune(tmp_path, 1, 3)
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["epoch-000002"]


def test_a_checkpoint_whose_workers_save_alone_is_complete_without_a_lost_workers_file_never_without_rank_0s(
        tmp_path):
    # async's workers save at their own epoch ends and rank 0 (the first member) holds the global model
    for epoch in (1, 2, 3):
        checkpoint_files.write_manifest(tmp_path, epoch, (0, 1, 2), "async", "abc", None, alone=True)
    for rank in (0, 1, 2):
        checkpoint_files.save(tmp_path, 1, rank, {"epoch": 1})
    checkpoint_files.save(tmp_path, 2, 0, {"epoch": 2})
    checkpoint_files.save(tmp_path, 2, 2, {"epoch": 2})
    checkpoint_files.save(tmp_path, 3, 1, {"epoch": 3})  # epoch 3 has no file of rank 0: not complete
    checkpoint_files.save(tmp_path, 3, 2, {"epoch": 3})
    assert checkpoint_files.latest_complete(tmp_path, 3) == (2, [
        "the checkpoint of epoch 3 was not finished; continuing from epoch 2",
        "the checkpoint of epoch 2 has no file of job rank 1 (lost before saving; its workers save alone): it is "
        "continued without it"])
    saved = checkpoint_files.manifest(tmp_path, 2, 3)
    assert saved["members"] == [0, 2] and saved["world_size"] == 2 and saved["lost_before_saving"] == [1]
    assert checkpoint_files.manifest(tmp_path, 1, 3)["members"] == [0, 1, 2]
    # a file that is there but corrupt is never taken for a lost worker's
    path = tmp_path / "checkpoints" / "epoch-000002" / "rank-00002.pt"
    path.write_bytes(path.read_bytes()[:-1] + b"x")
    assert checkpoint_files.latest_complete(tmp_path, 3)[0] == 1
    # a checkpoint of workers that save together (no "alone") still needs every member's file
    checkpoint_files.write_manifest(tmp_path, 4, (0, 1), "sync", "abc", None)
    checkpoint_files.save(tmp_path, 4, 0, {"epoch": 4})
    assert checkpoint_files.manifest(tmp_path, 4, 2)["members"] == [0, 1]
    assert checkpoint_files.latest_complete(tmp_path, 3)[0] == 1


def test_keep_checkpoints_leaves_exactly_that_many(tmp_path):
    result = dptrain(*BASE, "--dataset", "digits", "--epochs", "4", "--keep-checkpoints", "2", "--out", "R",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(path.name for path in (tmp_path / "R" / "checkpoints").iterdir()) == ["epoch-000003",
                                                                                       "epoch-000004"]
    saved = json.loads((tmp_path / "R" / "checkpoints" / "epoch-000004" / "checkpoint.json").read_text())
    assert saved == {"members": [0, 1], "world_size": 2, "strategy": "allreduce", "run_id": run_id(tmp_path / "R"),
                     "data": {"rows": 1437, "sha256": saved["data"]["sha256"]}}


def test_another_runs_checkpoint_is_refused_naming_both_run_ids(tmp_path):
    argv = [*BASE, "--dataset", "digits", "--epochs", "3"]
    other = dptrain(*argv, "--out", "other", cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    run = crashed(tmp_path, argv, "R")
    shutil.copytree(tmp_path / "other" / "checkpoints" / "epoch-000003", run / "checkpoints" / "epoch-000003")
    before = snapshot(run)
    refused = dptrain(*argv, "--out", "R", cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"dptrain: error: the checkpoint of epoch 3 in 'R' cannot be continued: it belongs to another run (run id "
        f"{run_id(tmp_path / 'other')}, this run's is {run_id(run)}); give --out a new directory, or copy no "
        "checkpoints between runs"]
    assert snapshot(run) == before


def write_digits(path: Path, rows: int, seed: int = 0) -> None:
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))[:rows] if seed else np.arange(rows)
    np.savez(path, x=(digits.data[order] / 16.0).astype(np.float32), y=digits.target[order])


def test_changed_training_data_is_refused_unless_the_user_says_to_go_on(tmp_path):
    write_digits(tmp_path / "digits.npz", 1797)
    argv = [*BASE, "--data", "digits.npz", "--epochs", "3"]
    run = crashed(tmp_path, argv, "R")
    write_digits(tmp_path / "digits.npz", 1500, seed=1)  # permuted, and fewer rows
    before = snapshot(run)
    refused = dptrain(*argv, "--out", "R", cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "dptrain: error: the checkpoint of epoch 1 in 'R' cannot be continued: it was trained on other data (1,438 "
        "training rows then, 1,200 now); give the same data to continue it, --resume-with-changed-data to go on "
        "with this data, or --out a new directory"]
    assert snapshot(run) == before
    again = dptrain(*argv, "--out", "R", "--resume-with-changed-data", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "dptrain: resuming after epoch 1 from R" in again.stdout + again.stderr
    assert [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    newest = json.loads((run / "checkpoints" / "epoch-000003" / "checkpoint.json").read_text())
    assert newest["data"]["rows"] == 1200  # from now on the run's checkpoints are of the data it trains on
