"""Pruning keeps the newest complete checkpoints, whatever other ranks are still writing.

Pure filesystem: rank files and checksums are fake bytes, because prune() decides by presence
(files are renamed into place whole) and never reads them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dptrain.train import checkpoint_files


def write(run_dir: Path, epoch: int, ranks, checksum: bool = True) -> None:
    directory = run_dir / "checkpoints" / f"epoch-{epoch:06d}"
    directory.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        (directory / f"rank-{rank:05d}.pt").write_bytes(b"state")
        if checksum:
            (directory / f"rank-{rank:05d}.pt.sha256").write_bytes(b"0" * 64)


def epochs_left(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.parametrize("keep, left", [(1, [2, 3]), (2, [1, 2, 3])])
def test_an_incomplete_newest_checkpoint_does_not_count(tmp_path, keep, left):
    for epoch in (1, 2):
        write(tmp_path, epoch, [0, 1])
    write(tmp_path, 3, [0])  # rank 1 was killed while writing epoch 3

    checkpoint_files.prune(tmp_path, keep, world_size=2)

    assert epochs_left(tmp_path) == left


def test_a_rank_file_without_its_checksum_is_not_complete(tmp_path):
    write(tmp_path, 1, [0, 1])
    write(tmp_path, 2, [0])
    write(tmp_path, 2, [1], checksum=False)  # the checksum is renamed into place first; this one never was

    checkpoint_files.prune(tmp_path, 1, world_size=2)

    assert epochs_left(tmp_path) == [1, 2]


@pytest.mark.parametrize("keep, left", [(1, [3, 4, 5, 6]), (2, [2, 3, 4, 5, 6])])
def test_async_staggered_ranks_keep_the_slow_workers_directories(tmp_path, keep, left):
    # Under async rank 0 runs ahead: it has written epochs 1-6 while the slow rank 1 is at epoch 3.
    for epoch in range(1, 7):
        write(tmp_path, epoch, [0, 1] if epoch <= 3 else [0])

    checkpoint_files.prune(tmp_path, keep, world_size=2)

    assert epochs_left(tmp_path) == left


def test_without_any_complete_checkpoint_nothing_is_deleted(tmp_path):
    for epoch in (1, 2, 3):
        write(tmp_path, epoch, [0])

    checkpoint_files.prune(tmp_path, 1, world_size=2)

    assert epochs_left(tmp_path) == [1, 2, 3]


@pytest.mark.parametrize("keep, left", [(1, [4]), (2, [3, 4])])
def test_complete_checkpoints_beyond_keep_are_deleted(tmp_path, keep, left):
    for epoch in range(1, 5):
        write(tmp_path, epoch, [0, 1, 2])

    checkpoint_files.prune(tmp_path, keep, world_size=3)

    assert epochs_left(tmp_path) == left
