"""Replacement and growth (issue 22, item 3): a worker joins a running job and heals from a live one.

`--workers MIN:MAX` (torchrun's spelling) starts MAX workers that go on down to MIN; the launcher
starts a new worker in place of each one that fails. `dptrain join RUN_DIR` adds a worker by hand
(a spare waits until a place is free). A joiner takes the next rank of the job, prepares alone,
and enters at an epoch end: rank 0 hands it its whole state over the new group (not from disk),
every epoch after that reads every training row once over the grown world, and the LR rule's W
follows the live world back up.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import pytest

from cli_runner import ForkedDptrain
from dptrain.config import build_config
from dptrain.errors import UserError
from test_elastic import BATCH, PARAMETER_BYTES, TRAIN_ROWS, records
from test_train_cli import dptrain

SLOW_RANK_0 = ["--slow-worker", "0:40"]  # rank 0's steps 40x as long: epochs long enough for a joiner to start


def grown(history: list[dict], joiner: int) -> int:
    """The index of the record of the first epoch the joiner trained in (after the one that admitted it)."""
    admitted = [i for i, record in enumerate(history) if record.get("membership", {}).get("joined")]
    assert len(admitted) == 1, [record.get("membership") for record in history]
    assert history[admitted[0]]["membership"]["joined"] == [joiner]
    return admitted[0]


@pytest.mark.slow
def test_a_lost_worker_is_replaced_by_a_new_one_that_heals_from_a_live_one(tmp_path):
    run = tmp_path / "replaced"
    # --lr-scaling auto: the LR guard of a scaled LR is on, and a joiner must take rank 0's kept average with its
    # state, or the two decide differently whether a divergence can be taken back (a collective mismatch).
    result = dptrain("train", "--dataset", "digits", "--strategy", "sync", "--workers", "2:3", "--epochs", "14",
                     "--lr", "0.05", "--lr-scaling", "auto", "--no-progress", "--out", str(run), *SLOW_RANK_0,
                     cwd=tmp_path, env={"DPTRAIN_FAULT": "train-middle@1:2"})
    assert result.returncode == 0, result.stderr
    assert "dptrain: worker rank 1 was killed by SIGKILL; the others go on without it" in result.stderr
    assert "dptrain: starting worker rank 3 in place of rank 1" in result.stderr
    history = records(run)
    first = grown(history, 3)
    change = history[first]["membership"]
    assert change["members"] == [0, 2, 3] and change["left"] == [] and change["healed_bytes"] > PARAMETER_BYTES
    assert change["continued_from_epoch"] == history[first]["epoch"]
    assert f"rank 3 joined after epoch {history[first]['epoch'] - 1}, healed from rank 0" in result.stdout
    # 3 workers, then 2 from the redone epoch 2, then 3 again: every epoch reads every row once
    assert [len(record["workers"]) for record in history] == [3] + [2] * (first - 1) + [3] * (len(history) - first)
    assert all(sum(worker["samples"] for worker in record["workers"]) == TRAIN_ROWS for record in history)
    # the LR rule's W follows the live world down and back up (auto: x W for sync, after a one-epoch warm-up)
    assert "learning rate x 0.667 for 2 workers instead of 3 (the LR rule follows the live world)" in result.stdout
    assert "learning rate x 1.5 for 3 workers instead of 2 (the LR rule follows the live world)" in result.stdout
    # (until the guard backs off, if it does: it halves the scale on every worker alike)
    backoff = next((i for i, record in enumerate(history) if record.get("lr_backoff")), len(history))
    assert [r["lr"] for r in history[1:backoff]] == pytest.approx([0.05 * len(r["workers"]) for r in history[1:backoff]])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 3 and summary["test_accuracy"] > 0.8
    assert not (run / "join.address").exists()


def wait_for(path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def train_while_one_joins(tmp_path, run, argv: list[str], env: Optional[dict] = None):
    """`dptrain train --dataset digits ARGV` into `run`, and `dptrain join run` as soon as the run takes workers:
    the join's CompletedProcess and the run's output, once both ended well."""
    training = ForkedDptrain(["train", "--dataset", "digits", "--no-progress", "--out", str(run), *argv], cwd=tmp_path,
                             env={**os.environ, **(env or {})})
    try:
        wait_for(run / "join.address")
        joined = dptrain("join", str(run), cwd=tmp_path, timeout=180)
        out, err = training.communicate(timeout=180)
    finally:
        training.kill()
    assert training.returncode == 0, err
    assert joined.returncode == 0, joined.stderr
    return joined, out


@pytest.mark.slow
def test_dptrain_join_adds_a_worker_that_takes_the_state_of_a_live_one_under_allreduce(tmp_path):
    run = tmp_path / "joined"
    joined, _ = train_while_one_joins(
        tmp_path, run, ["--strategy", "allreduce", "--workers", "3", "--min-workers", "2", "--epochs", "6",
                        "--lr", "0.05", "--slow-worker", "0:10"], {"DPTRAIN_FAULT": "train-middle@2:2"})
    assert "dptrain: rank 3 is ready to join the run" in joined.stdout
    assert f"dptrain: this worker (rank 3) trained with the others to the end of the run in {run}" in joined.stdout
    history = records(run)
    first = grown(history, 3)
    assert [len(record["workers"]) for record in history][first:] == [3] * (len(history) - first)
    assert all(sum(worker["samples"] for worker in record["workers"]) == TRAIN_ROWS for record in history)
    # The joiner waited as a spare from the start, for a place: rank 2's, lost in epoch 2. Its DDP broadcasts
    # nothing (its weights are rank 0's already): its bytes are one gradient a step.
    steps = 0
    for record in history[first:]:
        joiner = record["workers"][2]
        steps += -(-joiner["samples"] // BATCH)
        assert joiner["comm_bytes"] == PARAMETER_BYTES * steps, record["epoch"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 3 and summary["test_accuracy"] > 0.8


@pytest.mark.slow
def test_max_workers_lets_a_joiner_grow_the_run_beyond_the_workers_it_started_with(tmp_path):
    run = tmp_path / "grown"
    joined, out = train_while_one_joins(
        tmp_path, run, ["--strategy", "sync", "--workers", "2", "--min-workers", "2", "--max-workers", "3",
                        "--epochs", "6", "--lr", "0.05", "--lr-scaling", "auto", *SLOW_RANK_0])
    assert f"dptrain: this worker (rank 2) trained with the others to the end of the run in {run}" in joined.stdout
    history = records(run)
    first = grown(history, 2)  # the job's ranks 0 and 1, then the first joiner's: 2
    change = history[first]["membership"]
    assert change["members"] == [0, 1, 2] and change["left"] == [] and change["healed_bytes"] > PARAMETER_BYTES
    assert [len(record["workers"]) for record in history] == [2] * first + [3] * (len(history) - first)
    assert all(sum(worker["samples"] for worker in record["workers"]) == TRAIN_ROWS for record in history)
    assert "learning rate x 1.5 for 3 workers instead of 2 (the LR rule follows the live world)" in out
    assert "3 workers, 1 more than at the start (ranks 0, 1, 2)" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 3 and summary["test_accuracy"] > 0.8


@pytest.mark.slow
def test_a_spare_that_finds_no_free_place_goes_home_when_the_run_ends(tmp_path):
    run = tmp_path / "full"
    spare, _ = train_while_one_joins(tmp_path, run, ["--strategy", "fedavg", "--workers", "2", "--min-workers", "1",
                                                   "--epochs", "3", "--slow-worker", "0:20"])
    assert "dptrain: rank 2: the run ended before a place was free; this worker did not join" in spare.stderr
    assert [len(record["workers"]) for record in records(run)] == [2, 2, 2]


def test_join_needs_a_running_job_that_takes_workers(tmp_path):
    result = dptrain("join", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"dptrain: error: '{tmp_path}' is not a run directory (it has no config.yaml); "
                                     "give the --out of a running dptrain train")
    (tmp_path / "config.yaml").write_text("workers: 2\n")
    result = dptrain("join", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"dptrain: error: no job in '{tmp_path}' takes workers now: only a run training "
                                     "on this machine with --min-workers N or --workers MIN:MAX does, while it runs "
                                     "(join.address says where)")
    (tmp_path / "config.yaml").write_text("workers: 2\nstrategy: async\n")
    (tmp_path / "join.address").write_text("127.0.0.1:1\n")
    result = dptrain("join", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"dptrain: error: the run in '{tmp_path}' trains with strategy async, which "
                                     "takes no new worker: its workers never stand at an epoch end together for one "
                                     "to enter at")


def test_workers_min_max_is_max_workers_going_on_down_to_min_each_lost_one_replaced():
    config = build_config({"dataset": "digits", "strategy": "sync", "workers": "2:4"})
    assert (config.workers, config.min_workers, config.replace_workers) == (4, 2, True)


@pytest.mark.parametrize("values, message", [
    ({"workers": "2:x"}, "workers '2:x' must be N or MIN:MAX, two whole numbers, e.g. 2:4"),
    ({"workers": "3:2"}, "workers '3:2' must be MIN:MAX with 1 <= MIN <= MAX, e.g. 2:4"),
    ({"workers": "2:3", "min_workers": 2}, "workers 2:3 sets min_workers 2 already; drop min_workers"),
    ({"workers": "2:4", "shard": "hybrid", "shard_size": 2},
     "workers 2:4 counts ranks, and with --shard hybrid --min-workers counts replica groups; give --workers 4 "
     "--min-workers GROUPS --replace-workers"),
    ({"workers": 3, "replace_workers": True}, "replace_workers needs min_workers"),
    ({"workers": 3, "max_workers": 4}, "max_workers needs min_workers"),
    ({"workers": 3, "min_workers": 2, "max_workers": 2},
     "max_workers 2 is fewer than workers 3, the workers the run starts with; give 3 or more"),
    ({"workers": 3, "min_workers": 2, "max_workers": 4, "strategy": "async"},
     "--max-workers lets dptrain join add a new worker that enters at an epoch end all workers stand at"),
])
def test_bad_worker_ranges_are_one_line_naming_the_value(values, message):
    with pytest.raises(UserError, match=message):
        build_config({"dataset": "digits", "strategy": "sync", **values})


def test_info_on_a_run_directory_shows_its_live_workers_and_each_change(tmp_path):
    from dptrain.info import run_report
    from dptrain.train.rundir import lock_run_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("strategy: sync\nepochs: 6\nworkers: 3\nmin_workers: 2\nreplace_workers: true\n")
    left = {"generation": 1, "members": [0, 2], "left": [1], "continued_from_epoch": 2}
    joined = {"generation": 2, "members": [0, 2, 3], "left": [], "continued_from_epoch": 4, "joined": [3],
              "healed_bytes": 160953}
    records = [{"epoch": 1}, {"epoch": 2, "membership": left}, {"epoch": 3}, {"epoch": 4, "membership": joined}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    with lock_run_dir(str(run)):  # a launcher holds it while its workers run, and says where joiners connect
        (run / "join.address").write_text("127.0.0.1:1234\n")
        report = run_report(run)
        # a worker lost since: a place is free again
        lost = {"epoch": 5, "membership": {**left, "generation": 3, "continued_from_epoch": 5}}
        (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in [*records, lost]))
        assert run_report(run)["elastic"] == ("goes on down to 2 workers, each failed one replaced; `dptrain join` "
                                              "adds a worker now (2 of 3 train)")
        (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    assert report == {"run": str(run), "state": "running", "strategy": "sync", "epochs recorded": "4 of 6",
                      "live workers": "3 (ranks 0, 2, 3 of the job)",
                      "membership 1": "without rank 1: 2 workers from epoch 2",
                      "membership 2": "rank 3 joined: 3 workers from epoch 4",
                      "elastic": "goes on down to 2 workers, each failed one replaced; `dptrain join` waits as a spare "
                                 "now (3 of 3 train)"}
    (run / "join.address").unlink()
    assert run_report(run)["state"] == "stopped"
    result = dptrain("info", str(run), cwd=tmp_path, env={"COLUMNS": "200"})
    assert result.returncode == 0 and "rank 3 joined: 3 workers from epoch 4" in result.stdout
    (run / "config.yaml").write_text("strategy: sync\nepochs: 6\nworkers: 2\nmin_workers: 1\nmax_workers: 4\n")
    assert run_report(run)["elastic"] == "goes on down to 1 worker, grows up to 4 with `dptrain join`"
