"""async after losing a worker other than rank 0 finishes: model.pt and summary.json, every epoch's reading told.

Rank 0 is slowed (--slow-worker 0:10) so that the worker left waits for rank 0's conclusion for longer than the
0.5 s in which it looks for rank 0's loss: that wait once closed its connections (under gloo a point-to-point wait
that times out closes every connection of the group) and rank 0's answer failed with "Connection closed by peer".

What the per-epoch records hold under async (no epoch all workers stand at): each worker's numbers of every epoch
it finished, the lost worker's included (up to the epoch it was lost in). Before the epoch the workers left share
the data from (the membership record's), each reads its third of the shared permutation; the lost worker's third
of the epochs from the one it was lost in (its unmerged work never reaches the global model) is trained by the
workers left at the end, and those epochs' records say so (`rows_made_up`). From that epoch on the workers left
read every row once per epoch. So every epoch's workers' samples plus its rows made up are the training set.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dptrain.data.sharding import epoch_indices
from test_train_cli import dptrain

TRAIN_ROWS = 1437  # digits: 1797 rows, 20 % held out
EPOCHS = 6


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("lost", [1, 2])
def test_async_finishes_after_losing_a_worker_other_than_rank_0_and_every_epoch_says_who_read_what(tmp_path, lost):
    run = tmp_path / "run"
    result = dptrain("train", "--dataset", "digits", "--strategy", "async", "--workers", "3", "--min-workers", "2",
                     "--epochs", str(EPOCHS), "--slow-worker", "0:10", "--no-progress", "--out", str(run),
                     cwd=tmp_path, env={"DPTRAIN_FAULT": f"train-middle@{lost}:2",
                                        "DPTRAIN_FAULT_ONCE": str(tmp_path / "fired")})
    said = result.stdout + result.stderr
    assert result.returncode == 0, said
    assert "Connection closed by peer" not in said and "Traceback" not in said
    assert (run / "model.pt").is_file()
    summary = json.loads((run / "summary.json").read_text())
    survivors = [rank for rank in range(3) if rank != lost]
    assert summary["workers"] == 2 and summary["left"] == [lost] and len(summary["merges"]) == 2

    history = records(run)
    assert [record["epoch"] for record in history] == list(range(1, EPOCHS + 1))
    changes = [record for record in history if "membership" in record]
    assert len(changes) <= 1, [record["membership"] for record in changes]
    # where the loss was heard before the last epoch, the epoch the workers left share the data from says who left
    switch = changes[0]["epoch"] if changes else EPOCHS + 1
    if changes:
        assert changes[0]["membership"]["members"] == survivors and changes[0]["membership"]["left"] == [lost]
    for record in history:
        epoch, workers = record["epoch"], record["workers"]
        ranks = [worker["rank"] for worker in workers]
        if epoch == 1:  # the lost worker finished epoch 1 (it was killed halfway through epoch 2)
            places, world = [0, 1, 2], 3
        elif epoch < switch:
            places, world = survivors, 3
        else:
            places, world = [0, 1], 2
        assert ranks == (places if world == 3 else survivors), (epoch, ranks)
        rows = [epoch_indices(TRAIN_ROWS, place, world, epoch - 1, 0, "global") for place in places]
        assert [worker["samples"] for worker in workers] == [len(part) for part in rows], (epoch, workers)
        read = np.concatenate(rows)
        assert len(np.unique(read)) == len(read), epoch  # no row twice
        made_up = 0 if world == 2 or epoch == 1 else len(epoch_indices(TRAIN_ROWS, lost, 3, epoch - 1, 0, "global"))
        assert len(read) == TRAIN_ROWS - made_up, (epoch, len(read))
        assert record.get("rows_made_up", 0) == made_up, (epoch, record.get("rows_made_up"))  # trained at the end
    if switch > 2:
        assert "trained now by the run's 2 workers, from the final model, then averaged" in said

