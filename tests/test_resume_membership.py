"""A run whose membership changed resumes from its newest complete checkpoint, on any number of workers where
the strategy can (allreduce, sync, streaming, fedavg with iid partitions), and each epoch reads every row once.

Checkpoints are keyed by the job's ranks (rank-00000, rank-00002 after rank 1 was lost) and name their members
in a manifest, so the survivors' checkpoints count as complete when the run is continued with --workers 3 again;
a checkpoint within an epoch written by another number of workers has the rest of that epoch re-planned over the
new world. Strategies whose workers' state belongs to their place refuse another count in one line, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dptrain.data import sharding
from test_train_cli import dptrain

TRAIN_ROWS = 1437  # digits: 1797 rows, 20 % held out
BASE = ["train", "--dataset", "digits", "--model", "mlp", "--batch-size", "32", "--lr", "0.05", "--no-progress",
        "--out", "R"]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def folders(run: Path) -> list[str]:
    return sorted(path.name for path in (run / "checkpoints").iterdir())


def manifest(run: Path, folder: str) -> dict:
    return json.loads((run / "checkpoints" / folder / "checkpoint.json").read_text())


def assert_every_row_read_once_per_epoch(history: list[dict], epochs: int) -> None:
    """Epochs 1..epochs, each once; each reads every training row once (rows a lost worker had read before the
    survivors' last commit are counted apart, in the membership change)."""
    assert [record["epoch"] for record in history] == list(range(1, epochs + 1))
    for record in history:
        lost = record.get("membership", {}).get("rows_read_by_the_lost", 0)
        assert sum(worker["samples"] for worker in record["workers"]) + lost == TRAIN_ROWS, record


def snapshot(run: Path) -> dict:
    return {str(path): (path.stat().st_mtime_ns, path.stat().st_size) for path in sorted(run.rglob("*"))}


@pytest.mark.parametrize("strategy", [["sync"], ["allreduce", "--commit-every-steps", "5"], ["streaming"],
                                      ["hierarchical", "--ranks-per-node", "1"]],
                         ids=["sync", "allreduce", "streaming", "hierarchical"])
def test_the_survivors_checkpoints_resume_on_the_whole_world_again(tmp_path, strategy):
    # Rank 1 is killed in epoch 2 and the others go on; both are killed as they begin epoch 4's checkpoint.
    argv = [*BASE, "--strategy", *strategy, "--workers", "3", "--min-workers", "2", "--epochs", "6"]
    env = {"DPTRAIN_FAULT": "train-middle@1:2;save-begin@0,2:4", "DPTRAIN_FAULT_ONCE": str(tmp_path / "fired")}
    first = dptrain(*argv, cwd=tmp_path, env=env)
    run = tmp_path / "R"
    assert first.returncode != 0
    # The two newest complete checkpoints stay (epoch 1 too, when rank 0 pruned before rank 2 had written epoch 3)
    assert folders(run)[-2:] == ["epoch-000002", "epoch-000003"] and len(folders(run)) <= 3
    for folder in folders(run)[-2:]:
        assert manifest(run, folder)["members"] == [0, 2] and manifest(run, folder)["world_size"] == 2
        assert sorted(path.name for path in (run / "checkpoints" / folder).glob("*.pt")) == ["rank-00000.pt",
                                                                                          "rank-00002.pt"]
    again = dptrain(*argv, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    said = again.stdout + again.stderr
    assert ("dptrain: resuming after epoch 3 from R on 3 workers (written by 2: job ranks 0, 2); the epochs from 4 "
            "on planned over 3 workers") in said
    assert "not finished" not in said and "starting the run over" not in said
    history = records(run)
    assert_every_row_read_once_per_epoch(history, 6)
    assert [len(record["workers"]) for record in history] == [3, 2, 2, 3, 3, 3]
    assert folders(run) == ["epoch-000005", "epoch-000006"]  # --keep-checkpoints 2, pruned again at the end
    assert json.loads((run / "summary.json").read_text())["workers"] == 3


@pytest.mark.parametrize("before, after", [(3, 2), (2, 3)])
def test_a_checkpoint_within_an_epoch_resumes_on_another_number_of_workers_reading_each_row_once(
        tmp_path, before, after):
    # Every rank killed after the 7th step of epoch 2: the newest complete checkpoint is step 6 of epoch 2.
    steps = sharding.steps_per_epoch(TRAIN_ROWS, before, 32)
    argv = [*BASE, "--strategy", "allreduce", "--checkpoint-every-steps", "3", "--epochs", "3"]
    ranks = ",".join(map(str, range(before)))
    env = {"DPTRAIN_FAULT": f"step@{ranks}:{steps + 7}", "DPTRAIN_FAULT_ONCE": str(tmp_path / "fired")}
    first = dptrain(*argv, "--workers", str(before), cwd=tmp_path, env=env)
    run = tmp_path / "R"
    assert first.returncode != 0
    assert manifest(run, "epoch-000001-step-000006")["members"] == list(range(before))
    again = dptrain(*argv, "--workers", str(after), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    members = ", ".join(map(str, range(before)))
    assert (f"dptrain: resuming at step 6 of epoch 2 from R on {after} workers (written by {before}: job ranks "
            f"{members}); the rest of epoch 2 re-planned over {after} workers") in again.stdout + again.stderr
    history = records(run)
    assert_every_row_read_once_per_epoch(history, 3)
    assert [len(record["workers"]) for record in history] == [before, after, after]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.5
    # the bytes of a writer that does not carry on (3 -> 2) stay in the total, as of the last record before
    gone = sum(worker["comm_bytes"] for worker in history[0]["workers"][after:])
    assert summary["comm_bytes"] - sum(summary["comm_bytes_per_worker"]) == gone


@pytest.mark.parametrize("strategy, why", [
    (["fedavg", "--partition", "dirichlet"],
     "its dirichlet partitions give each client data of its own, which iid ones do not"),
], ids=["fedavg-dirichlet"])
def test_a_strategy_that_cannot_resume_on_another_number_of_workers_says_so_in_one_line(tmp_path, strategy, why):
    argv = [*BASE, "--strategy", *strategy, "--epochs", "3"]
    env = {"DPTRAIN_FAULT": "save-begin@0:2", "DPTRAIN_FAULT_ONCE": str(tmp_path / "fired")}
    assert dptrain(*argv, "--workers", "2", cwd=tmp_path, env=env).returncode != 0
    before = snapshot(tmp_path / "R")
    refused = dptrain(*argv, "--workers", "3", cwd=tmp_path)
    assert refused.returncode == 2
    name = strategy[0]
    assert refused.stderr.strip().splitlines() == [
        f"dptrain: error: run directory 'R' holds a run of {name} on 2 workers, 3 now: {name} cannot resume on "
        f"another number of workers ({why}); give --workers 2 to continue it (allreduce, sync, streaming, async and "
        "fedavg with iid partitions resume on any number, hierarchical at an epoch end), or --out a new directory"]
    assert snapshot(tmp_path / "R") == before


def test_hierarchical_resumes_a_checkpoint_within_an_epoch_only_on_the_workers_that_wrote_it(tmp_path):
    # Within an epoch each node's replica differs from the others' (they meet at the period's end), and the nodes
    # are laid out anew on another number of workers: refused in one line, nothing touched.
    argv = [*BASE, "--strategy", "hierarchical", "--ranks-per-node", "2", "--checkpoint-every-steps", "3",
            "--epochs", "3"]
    steps = sharding.steps_per_epoch(TRAIN_ROWS, 4, 32)
    env = {"DPTRAIN_FAULT": f"step@0:{steps + 7}", "DPTRAIN_FAULT_ONCE": str(tmp_path / "fired")}
    assert dptrain(*argv, "--workers", "4", cwd=tmp_path, env=env).returncode != 0
    before = snapshot(tmp_path / "R")
    refused = dptrain(*argv, "--workers", "2", cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "dptrain: error: the checkpoint of step 6 of epoch 2 in 'R' was written by 4: job ranks 0, 1, 2, 3, and "
        "hierarchical cannot resume on another number of workers (2 now): a checkpoint within an epoch holds each "
        "node's replica apart from the others', and the nodes are laid out anew on another number of workers; give "
        "--workers 4 to continue it (allreduce, sync, streaming, async and fedavg with iid partitions resume on any "
        "number, hierarchical at an epoch end)"]
    assert snapshot(tmp_path / "R") == before


def test_fedavg_resumes_a_checkpoint_within_an_epoch_only_on_the_workers_that_wrote_it(tmp_path):
    argv = [*BASE, "--strategy", "fedavg", "--checkpoint-every-steps", "3", "--epochs", "3"]
    steps = sharding.steps_per_epoch(TRAIN_ROWS, 2, 32)
    env = {"DPTRAIN_FAULT": f"step@0,1:{steps + 7}", "DPTRAIN_FAULT_ONCE": str(tmp_path / "fired")}
    assert dptrain(*argv, "--workers", "2", cwd=tmp_path, env=env).returncode != 0
    before = snapshot(tmp_path / "R")
    refused = dptrain(*argv, "--workers", "3", cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "dptrain: error: the checkpoint of step 6 of epoch 2 in 'R' was written by 2: job ranks 0, 1, and fedavg "
        "cannot resume on another number of workers (3 now): a checkpoint within an epoch holds each client's place "
        "in its own partition, one at an epoch end does not; give --workers 2 to continue it (allreduce, sync, "
        "streaming, async and fedavg with iid partitions resume on any number, hierarchical at an epoch end)"]
    assert snapshot(tmp_path / "R") == before
    again = dptrain(*argv, "--workers", "2", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "dptrain: resuming at step 6 of epoch 2 from R" in again.stdout + again.stderr
    assert [record["epoch"] for record in records(tmp_path / "R")] == [1, 2, 3]


def test_async_resumes_on_more_workers_and_without_the_file_of_a_worker_lost_before_it_saved(tmp_path):
    # Rank 1 is killed as it begins epoch 2's checkpoint, the others go on (--min-workers 2) and are killed once
    # their epoch-2 files are written: that checkpoint is complete without rank 1's file (async's workers save
    # alone; rank 0's holds the global model), whether the service had left rank 1 out when rank 0 wrote the
    # manifest or not. The same command again continues it on 3 workers, the third a copy of rank 0.
    # Rank 1 is slowed (5x its compute) so that ranks 0 and 2 save epoch 2 before it is lost: without that, ranks
    # 1 and 2 could both be gone before rank 0 (which also evaluates) had saved, and the launcher stopped it.
    argv = [*BASE, "--strategy", "async", "--workers", "3", "--min-workers", "2", "--epochs", "4", "--slow-worker", "1:5"]
    env = {"DPTRAIN_FAULT": "save-begin@1:2;save-end@0,2:2", "DPTRAIN_FAULT_ONCE": str(tmp_path / "fired")}
    assert dptrain(*argv, cwd=tmp_path, env=env).returncode != 0
    run = tmp_path / "R"
    assert sorted(path.name for path in (run / "checkpoints" / "epoch-000002").glob("*.pt")) == [
        "rank-00000.pt", "rank-00002.pt"]
    named = manifest(run, "epoch-000002")["members"]
    again = dptrain(*argv, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    said = again.stdout + again.stderr
    assert ("dptrain: resuming after epoch 2 from R on 3 workers (written by 2: job ranks 0, 2); the epochs from 3 "
            "on planned over 3 workers") in said
    assert "starting the run over" not in said and "not finished" not in said
    if named == [0, 1, 2]:  # written before the service heard of the loss
        assert ("the checkpoint of epoch 2 has no file of job rank 1 (lost before saving; its workers save alone): "
                "it is continued without it") in said
    history = records(run)
    assert [record["epoch"] for record in history] == [1, 2, 3, 4]
    assert [len(record["workers"]) for record in history[2:]] == [3, 3]
    for record in history[2:]:  # the epochs after the resume: every row read once, over 3 workers again
        assert sum(worker["samples"] for worker in record["workers"]) == TRAIN_ROWS
    # Before it, each worker once under its own rank (a copy of rank 0's file once recorded rank 0 three times,
    # which made the epochs look whole); what no merge brought in was made up at the end, so the rows add up.
    for record in history:
        ranks = [worker["rank"] for worker in record["workers"]]
        assert len(set(ranks)) == len(ranks), (record["epoch"], ranks)
        read = sum(worker["samples"] for worker in record["workers"])
        assert read + record.get("rows_made_up", 0) == TRAIN_ROWS, (record["epoch"], ranks, record.get("rows_made_up"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 3 and len(summary["merges"]) == 3
    assert (run / "model.pt").is_file() and summary["test_accuracy"] > 0.5
