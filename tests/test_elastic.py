"""Live membership (--min-workers): a worker killed or frozen mid-epoch is left behind and the others go on.

The survivors keep their processes: they leave the failed group, agree through the rendezvous store
on who is left (dptrain.runtime.membership), return to their state from before the epoch the worker
died in and redo that epoch over the new world. No epoch is recorded twice, every training row is
read exactly once per epoch before and after the change, and the result is defined: as if the lost
worker's part of that epoch never happened, so a kill and a freeze at the same step give the same weights.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from distributed import run_distributed
from dptrain.config import build_config
from dptrain.errors import UserError
from dptrain.lr_policy import lr_factor
from test_train_cli import dptrain

TRAIN_ROWS = 1437  # digits: 1797 rows, 20 % held out
KILL = {"DPTRAIN_FAULT": "train-middle@2:2"}  # rank 2, halfway through epoch 2


def elastic_argv(out) -> list[str]:
    return ["train", "--dataset", "digits", "--strategy", "sync", "--workers", "3", "--min-workers", "2",
            "--epochs", "4", "--lr", "0.05", "--no-progress", "--out", str(out)]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """The same run three times: rank 2 killed in epoch 2, frozen there (SIGSTOP), or warned there (SIGUSR1)."""
    root = tmp_path_factory.mktemp("elastic")
    runs = []
    for name, action in (("killed", "kill"), ("frozen", "freeze"), ("left", "stop")):
        result = dptrain(*elastic_argv(root / name), cwd=root, env={**KILL, "DPTRAIN_FAULT_ACTION": action})
        runs.append((root / name, result))
    return runs


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_survivors_finish_the_run_without_the_killed_worker(killed_runs):
    run, result = killed_runs[0]
    assert result.returncode == 0, result.stderr
    assert "dptrain: worker rank 2 was killed by SIGKILL; the others go on without it" in result.stderr
    said = result.stdout + result.stderr
    assert "continuing from epoch 2 with 2 workers (ranks 0, 1 of the job; without rank 2)" in said
    epoch_lines = [line for line in result.stdout.splitlines() if re.search(r"\bepoch \d/4  train_loss", line)]
    assert [line.endswith("  2 of 3 workers (ranks 0, 1)") for line in epoch_lines] == [False, True, True, True]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["epochs"] == 4
    assert summary["test_accuracy"] > 0.8


def assert_epoch_2_redone_without_rank_2(history: list[dict]) -> None:
    """Each epoch recorded once, every row read once in each, epoch 2 done again by ranks 0 and 1 alone."""
    assert [record["epoch"] for record in history] == [1, 2, 3, 4]
    assert [len(record["workers"]) for record in history] == [3, 2, 2, 2]
    for record in history:
        assert sum(worker["samples"] for worker in record["workers"]) == TRAIN_ROWS
    assert history[1]["membership"] == {"generation": 1, "members": [0, 1], "left": [2], "continued_from_epoch": 2}
    assert all("membership" not in record for record in history[:1] + history[2:])


def test_each_epoch_is_recorded_once_and_reads_every_row_once(killed_runs):
    history = records(killed_runs[0][0])
    assert_epoch_2_redone_without_rank_2(history)


def test_a_frozen_worker_is_given_up_after_its_heartbeat_stops_and_stopped_at_the_end(killed_runs):
    run, result = killed_runs[1]
    assert result.returncode == 0, result.stderr
    said = result.stdout + result.stderr
    # Rank 0 sees the quiet heartbeat itself, or rank 1 saw it first and left the group (rank 0 follows).
    assert re.search(r"rank 0: an all-reduce (waits on rank 2, quiet for 3 s \(no heartbeat\): frozen or gone|"
                     r"was given up: rank 1 saw a worker fail in the job and left it)", said), said
    assert "continuing from epoch 2 with 2 workers (ranks 0, 1 of the job; without rank 2)" in said
    assert ("dptrain: worker rank 2 was still running after the others finished without it (frozen); stopping it"
            in result.stderr)
    assert [len(record["workers"]) for record in records(run)] == [3, 2, 2, 2]


def test_a_kill_and_a_freeze_at_the_same_step_give_the_same_weights(killed_runs):
    (first, a), (second, b), _ = killed_runs
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    one = torch.load(first / "model.pt", weights_only=True)
    two = torch.load(second / "model.pt", weights_only=True)
    assert one.keys() == two.keys() and all(torch.equal(one[name], two[name]) for name in one)


def test_a_worker_warned_alone_leaves_at_the_epoch_end_and_the_others_go_on_without_redoing_it(killed_runs):
    (killed, _), _, (run, result) = killed_runs
    assert result.returncode == 0, result.stderr
    said = result.stdout + result.stderr
    assert "rank 2: left the run after epoch 2 on SIGUSR1; the other 2 workers go on without it" in said
    assert "rank 2 left after epoch 2 on request (SIGUSR1); continuing with 2 workers (ranks 0, 1 of the job)" in said
    assert "was killed" not in said and "stopping the other" not in said
    history = records(run)
    assert [len(record["workers"]) for record in history] == [3, 3, 2, 2]  # epoch 2 is not done again
    for record in history:
        assert sum(worker["samples"] for worker in record["workers"]) == TRAIN_ROWS
    assert history[2]["membership"] == {"generation": 1, "members": [0, 1], "left": [2], "continued_from_epoch": 3}
    assert history[0]["train_loss"] == records(killed)[0]["train_loss"]  # the same run until it left
    assert json.loads((run / "summary.json").read_text())["workers"] == 2


def test_losing_rank_0_is_survived_too_the_launcher_serves_the_store_and_rank_1_writes_the_results(tmp_path):
    result = dptrain(*elastic_argv(tmp_path / "run"), cwd=tmp_path, env={"DPTRAIN_FAULT": "train-middle@0:2"})
    assert result.returncode == 0, result.stderr
    assert "dptrain: worker rank 0 was killed by SIGKILL; the others go on without it" in result.stderr
    assert "[rank1] dptrain: continuing from epoch 2 with 2 workers (ranks 1, 2 of the job; without rank 0)" in (
        result.stdout)
    history = records(tmp_path / "run")  # rank 0 wrote epoch 1, rank 1 the rest
    assert [len(record["workers"]) for record in history] == [3, 2, 2, 2]
    for record in history:
        assert sum(worker["samples"] for worker in record["workers"]) == TRAIN_ROWS
    assert history[1]["membership"] == {"generation": 1, "members": [1, 2], "left": [0], "continued_from_epoch": 2}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["test_accuracy"] > 0.8 and (tmp_path / "run" / "model.pt").is_file()


def test_fedavg_goes_on_without_a_killed_client_partitioned_again_over_the_others(tmp_path):
    argv = elastic_argv(tmp_path / "fedavg")
    argv[argv.index("sync")] = "fedavg"
    result = dptrain(*argv, cwd=tmp_path, env={**KILL, "DPTRAIN_FAULT_ACTION": "kill"})
    assert result.returncode == 0, result.stderr
    assert "continuing from epoch 2 with 2 workers (ranks 0, 1 of the job; without rank 2)" in result.stdout
    history = records(tmp_path / "fedavg")
    assert [len(record["workers"]) for record in history] == [3, 2, 2, 2]
    for record in history:  # the lost client's rows are read by the others: none lost, none twice
        assert sum(worker["samples"] for worker in record["workers"]) == TRAIN_ROWS
    summary = json.loads((tmp_path / "fedavg" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["test_accuracy"] > 0.8


@pytest.mark.slow
def test_two_workers_killed_at_once_are_left_out_together(tmp_path):
    argv = elastic_argv(tmp_path / "two")
    argv[argv.index("--workers") + 1] = "4"
    result = dptrain(*argv, cwd=tmp_path, env={"DPTRAIN_FAULT": "train-middle@2,3:2"})
    assert result.returncode == 0, result.stderr
    for rank in (2, 3):
        assert f"dptrain: worker rank {rank} was killed by SIGKILL; the others go on without it" in result.stderr
    assert "continuing from epoch 2 with 2 workers (ranks 0, 1 of the job; without ranks 2, 3)" in result.stdout
    history = records(tmp_path / "two")
    assert [len(record["workers"]) for record in history] == [4, 2, 2, 2]
    assert all(sum(worker["samples"] for worker in record["workers"]) == TRAIN_ROWS for record in history)
    assert history[1]["membership"] == {"generation": 1, "members": [0, 1], "left": [2, 3], "continued_from_epoch": 2}
    # the bytes ranks 2 and 3 sent stay in the totals: as of epoch 1, the last they trained in
    departed = sum(worker["comm_bytes"] for worker in history[0]["workers"] if worker["rank"] in (2, 3))
    assert departed > 0
    for record in history[1:]:
        assert record["comm_bytes"] == sum(worker["comm_bytes"] for worker in record["workers"]) + departed
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["comm_bytes"] == history[-1]["comm_bytes"] == sum(summary["comm_bytes_per_worker"]) + departed


def test_a_worker_lost_while_the_others_build_the_new_group_is_left_out_at_once_not_after_the_timeout(tmp_path):
    """Rank 3 is killed in epoch 2; rank 1 says it is alive, learns who is left, then dies before the new group
    is built (the fault point regroup). Building a gloo group waits for every member for --timeout (here 600 s);
    the others see rank 1's process end, give that group up and agree again: generation 2, ranks 0 and 2."""
    argv = elastic_argv(tmp_path / "run") + ["--timeout", "600"]
    argv[argv.index("--workers") + 1] = "4"
    # (waiting for the timeout would take the run past this test's 300 s)
    result = dptrain(*argv, cwd=tmp_path, env={"DPTRAIN_FAULT": "train-middle@3:2;regroup@1:2"}, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "continuing from epoch 2 with 2 workers (ranks 0, 2 of the job; without ranks 1, 3)" in result.stdout
    history = records(tmp_path / "run")
    assert [len(record["workers"]) for record in history] == [4, 2, 2, 2]
    assert all(sum(worker["samples"] for worker in record["workers"]) == TRAIN_ROWS for record in history)
    assert history[1]["membership"] == {"generation": 2, "members": [0, 2], "left": [1, 3], "continued_from_epoch": 2}


# Job rank 1 killed halfway through epoch 1; the second fault then names job rank 2, which the survivors' new group
# numbers 1: at its 30th step (epoch 2: epoch 1, redone by two workers, has 23), or before its epoch-2 checkpoint.
@pytest.mark.parametrize("second", ["step@2:30", "save-begin@2:2"])
def test_a_fault_names_the_rank_of_the_job_after_a_change_of_members(tmp_path, second):
    argv = elastic_argv(tmp_path / "run")
    argv[argv.index("--min-workers") + 1] = "1"
    argv[argv.index("--epochs") + 1] = "3"
    result = dptrain(*argv, cwd=tmp_path, env={"DPTRAIN_FAULT": f"train-middle@1:1;{second}"})
    assert result.returncode == 0, result.stderr
    killed = re.findall(r"dptrain: worker rank (\d+) was killed by SIGKILL", result.stderr)
    assert killed == ["1", "2"], result.stderr
    changes = [record["membership"] for record in records(tmp_path / "run") if record.get("membership")]
    assert [change["left"] for change in changes] == [[1], [2]], changes  # not job rank 0, now the group's rank 0
    assert changes[-1]["members"] == [0]


@pytest.mark.slow
def test_the_lr_rule_and_a_per_step_schedule_follow_the_live_world(tmp_path):
    # --lr-scaling linear: 3 x the LR on 3 workers, 2 x on 2; cosine over the run, whatever an epoch's length:
    # after the world shrank each worker takes more steps per epoch, and the schedule neither runs ahead nor
    # stays on 3 workers' LR.
    argv = argv_for("allreduce", tmp_path / "lr") + ["--lr-scaling", "linear", "--lr-schedule", "cosine"]
    result = dptrain(*argv, cwd=tmp_path, env={**KILL, "DPTRAIN_FAULT_ACTION": "kill"})
    assert result.returncode == 0, result.stderr
    assert "learning rate x 0.667 for 2 workers instead of 3 (the LR rule follows the live world)" in result.stdout
    history = records(tmp_path / "lr")
    assert [len(record["workers"]) for record in history] == [3, 2, 2, 2]
    for record in history:  # the LR after the epoch's last step: at progress epoch / 4 of the cosine
        cosine = lr_factor(record["epoch"] * 100, steps_per_epoch=100, epochs=4, schedule="cosine")
        assert record["lr"] == pytest.approx(0.05 * len(record["workers"]) * cosine, abs=1e-9), record["epoch"]


PARAMETER_BYTES = 17226 * 4  # the digits model's parameters, float32
BATCH = 32


def argv_for(strategy: str, out) -> list[str]:
    argv = elastic_argv(out)
    argv[argv.index("sync")] = strategy
    return argv


def assert_allreduce_bytes(history: list[dict]) -> None:
    """Each worker's comm_bytes after each epoch: DDP's start-up broadcast and one gradient of every step it
    kept (the steps of a lost half epoch went with the state the survivors returned to; the new DDP broadcasts
    nothing: their weights are equal), at any world size."""
    steps: dict[int, int] = {}
    for record in history:
        for worker in record["workers"]:
            steps[worker["rank"]] = steps.get(worker["rank"], 0) + -(-worker["samples"] // BATCH)
            assert worker["comm_bytes"] == PARAMETER_BYTES * (1 + steps[worker["rank"]]), (record["epoch"], worker)


@pytest.mark.slow
def test_allreduce_goes_on_without_a_killed_worker_on_a_new_ddp(tmp_path):
    run = tmp_path / "allreduce"
    result = dptrain(*argv_for("allreduce", run), cwd=tmp_path, env={**KILL, "DPTRAIN_FAULT_ACTION": "kill"})
    assert result.returncode == 0, result.stderr
    assert "dptrain: worker rank 2 was killed by SIGKILL; the others go on without it" in result.stderr
    assert "continuing from epoch 2 with 2 workers (ranks 0, 1 of the job; without rank 2)" in result.stdout
    history = records(run)
    assert_epoch_2_redone_without_rank_2(history)
    assert_allreduce_bytes(history)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["test_accuracy"] > 0.8
    assert summary["comm_bytes_per_worker"] == [history[-1]["workers"][0]["comm_bytes"]] * 2


@pytest.fixture(scope="module")
def committed_runs(tmp_path_factory):
    """allreduce with a commit every 4 steps: rank 2 killed (or frozen) before step 8 of epoch 2's 15."""
    root = tmp_path_factory.mktemp("commits")
    runs = []
    for name, action in (("killed", "kill"), ("frozen", "freeze")):
        argv = [*argv_for("allreduce", root / name), "--commit-every-steps", "4"]
        runs.append((root / name, dptrain(*argv, cwd=root, env={**KILL, "DPTRAIN_FAULT_ACTION": action})))
    return runs


def test_allreduce_goes_on_from_its_last_commit_with_the_rest_of_the_epoch_shared_over_the_survivors(committed_runs):
    """The survivors go back to step 4 of epoch 2 (their last commit), not to its start: the rows nobody had read by
    then (1437 - 3 x 128) are shared over the two, and rank 2's 128 rows of steps 1-4 stay trained. Every row
    is read once in every epoch, epoch 2 included, and it is recorded once."""
    run, result = committed_runs[0]
    assert result.returncode == 0, result.stderr
    assert ("continuing from epoch 2 at step 4 of it (its last commit; the rest of its rows shared over them) with "
            "2 workers (ranks 0, 1 of the job; without rank 2)") in result.stdout
    history = records(run)
    assert [record["epoch"] for record in history] == [1, 2, 3, 4]
    assert [len(record["workers"]) for record in history] == [3, 2, 2, 2]
    assert history[1]["membership"] == {"generation": 1, "members": [0, 1], "left": [2], "continued_from_epoch": 2,
                                        "continued_from_step": 4, "rows_read_by_the_lost": 128}
    assert sorted(worker["samples"] for worker in history[1]["workers"]) == [128 + 526, 128 + 527]
    for record in history:
        lost = record.get("membership", {}).get("rows_read_by_the_lost", 0)
        assert sum(worker["samples"] for worker in record["workers"]) + lost == TRAIN_ROWS
    # DDP's start-up broadcast and one gradient of every step kept: 15 of epoch 1, 4 + 17 of epoch 2 (the 3 after
    # the commit went with the state the survivors returned to), 23 of each epoch after
    assert [[worker["comm_bytes"] for worker in record["workers"]] for record in history[1:]] == [
        [PARAMETER_BYTES * (1 + 15 + 21 + 23 * k)] * 2 for k in range(3)]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["test_accuracy"] > 0.8


def test_from_a_commit_a_kill_and_a_freeze_at_the_same_step_give_the_same_weights(committed_runs):
    (killed, kill), (frozen, freeze) = committed_runs
    assert kill.returncode == 0 and freeze.returncode == 0, freeze.stderr
    first, second = (torch.load(run / "model.pt") for run in (killed, frozen))
    assert first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)


@pytest.mark.slow
def test_streaming_gives_up_a_frozen_worker_and_drops_the_average_in_flight(tmp_path):
    run = tmp_path / "streaming"
    result = dptrain(*argv_for("streaming", run), cwd=tmp_path, env={**KILL, "DPTRAIN_FAULT_ACTION": "freeze"})
    assert result.returncode == 0, result.stderr
    said = result.stdout + result.stderr
    assert re.search(r"rank 0: .* (waits on rank 2, quiet for 3 s \(no heartbeat\): frozen or gone|was given up: "
                     r"rank 1 saw a worker fail in the job and left it)", said), said
    assert "continuing from epoch 2 with 2 workers (ranks 0, 1 of the job; without rank 2)" in said
    history = records(run)
    assert_epoch_2_redone_without_rank_2(history)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["test_accuracy"] > 0.8


@pytest.mark.parametrize("values, message", [
    ({"strategy": "sync", "workers": 3, "min_workers": 4}, "--min-workers 4 is more than --workers 3; use 1 to 3"),
    ({"strategy": "sync", "workers": 3, "min_workers": 2, "checkpoint_every_steps": 5},
     "--min-workers goes back to the start of an epoch when a worker is lost"),
    ({"strategy": "allreduce", "workers": 3, "min_workers": 4}, "--min-workers 4 is more than --workers 3"),
    ({"strategy": "async", "workers": 3, "min_workers": 4}, "--min-workers 4 is more than --workers 3"),
    ({"strategy": "async", "workers": "2:3"},
     "--replace-workers \\(and --workers MIN:MAX\\) start a new worker that enters at an epoch end all workers "
     "stand at, which async's never do; use --min-workers alone"),
    ({"strategy": "hierarchical", "workers": 3, "min_workers": 4}, "--min-workers 4 is more than --workers 3"),
    ({"strategy": "auto", "workers": "2:3", "auto_candidates": "all"},
     "--replace-workers \\(and --workers MIN:MAX\\) do not apply to --auto-candidates all: it may pick async"),
])
def test_min_workers_is_refused_where_it_cannot_hold(values, message):
    with pytest.raises(UserError, match=message):
        build_config(values)


def test_the_python_api_refuses_min_workers_to_a_strategy_that_cannot_go_on_without_a_worker(tmp_path):
    script = ("import torch, dptrain\n"
              "def main():\n"
              "    model = torch.nn.Linear(4, 2)\n"
              "    trainer = dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "
              "strategy=dptrain.strategies.Strategy(), min_workers=1, verbose=False)\n"
              "    trainer.fit((torch.zeros(8, 4), torch.zeros(8, dtype=torch.long)))\n"
              "dptrain.run(main)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("dptrain: error: min_workers does not apply to strategy local: it cannot "
                                   "go on without a lost worker")


def test_the_python_api_refuses_commits_to_a_strategy_whose_workers_do_not_meet_at_every_step(tmp_path):
    from dptrain.strategies.sync import Sync
    from dptrain.train.trainer import Trainer

    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="commit_every_steps needs min_workers"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), commit_every_steps=4)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=Sync(), min_workers=1,
                      commit_every_steps=4, verbose=False)
    with pytest.raises(UserError, match="^commit_every_steps does not apply to strategy sync: its workers do not "
                                        "meet at every step"):
        trainer.fit((torch.zeros(8, 4), torch.zeros(8, dtype=torch.long)))


@pytest.mark.slow
def test_hierarchical_goes_on_without_a_node_leader_on_node_groups_made_again(tmp_path):
    # 4 workers on 2 emulated nodes of 2; rank 2, the second node's leader, killed in epoch 2: node 0 keeps ranks
    # 0 and 1 (of the new group), node 1 is rank 3 of the job alone (its own leader now), and the leaders average.
    run = tmp_path / "hierarchical"
    argv = argv_for("hierarchical", run) + ["--ranks-per-node", "2"]
    argv[argv.index("--workers") + 1] = "4"
    result = dptrain(*argv, cwd=tmp_path, env=KILL)
    assert result.returncode == 0, result.stderr
    assert "continuing from epoch 2 with 3 workers (ranks 0, 1, 3 of the job; without rank 2)" in result.stdout
    history = records(run)
    assert [len(record["workers"]) for record in history] == [4, 3, 3, 3]
    assert all(sum(worker["samples"] for worker in record["workers"]) == TRAIN_ROWS for record in history)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["nodes"] == [[0, 1], [2]] and summary["averages"] == 4
    assert summary["workers"] == 3 and summary["test_accuracy"] > 0.8


def test_async_goes_on_without_a_killed_worker_merging_over_the_others_without_going_back(tmp_path):
    """async has no epoch end its workers stand at together: nobody goes back. The merge service leaves rank 2
    out once the launcher sees it die, merges over 2 from then on, and the workers left share the data from the
    first epoch each is sure to start after hearing of it (recorded there, once). Rank 2's numbers of epoch 1, which
    it finished, stay in the records; from epoch 2 until that epoch each survivor reads its third of the rows (rank
    2's third is not trained); from it on every row once per epoch."""
    run = tmp_path / "run"
    argv = ["train", "--dataset", "digits", "--strategy", "async", "--workers", "3", "--min-workers", "2",
            "--epochs", "40", "--lr", "0.05", "--no-progress", "--out", str(run)]
    result = dptrain(*argv, cwd=tmp_path, env=KILL)
    assert result.returncode == 0, result.stderr
    history = records(run)
    assert [record["epoch"] for record in history] == list(range(1, 41))
    changes = [record for record in history if "membership" in record]
    assert len(changes) == 1, [record.get("membership") for record in history]
    switch = changes[0]["epoch"]
    assert 2 < switch <= 40
    assert changes[0]["membership"] == {"generation": 1, "members": [0, 1], "left": [2],
                                        "continued_from_epoch": switch}
    said = result.stdout + result.stderr
    assert (f"dptrain: without rank 2: 2 workers share the data from epoch {switch} (ranks 0, 1 of the job); "
            "async merged over them since the loss") in said
    for record in history:
        rows = [worker["samples"] for worker in record["workers"]]
        expected = [479, 479, 479] if record["epoch"] == 1 else [479, 479] if record["epoch"] < switch else [718, 719]
        assert rows == expected, (record["epoch"], rows)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and len(summary["merges"]) == 2 and summary["left"] == [2]
    assert summary["test_accuracy"] > 0.9


def async_run(tmp_path, workers: int, fault: str):
    """An async run of 40 epochs on `workers` with --min-workers 2 and the fault `fault`, which it survives:
    (its directory, the finished process, everything it said)."""
    run = tmp_path / "run"
    result = dptrain("train", "--dataset", "digits", "--strategy", "async", "--workers", str(workers),
                     "--min-workers", "2", "--epochs", "40", "--lr", "0.05", "--no-progress", "--out", str(run),
                     cwd=tmp_path, env={"DPTRAIN_FAULT": fault})
    assert result.returncode == 0, result.stderr
    return run, result, result.stdout + result.stderr


def test_async_goes_on_without_rank_0_the_next_rank_takes_the_global_model_over_and_writes_the_results(tmp_path):
    """Rank 0 holds the global model and the merge service. Killed in epoch 2 (the launcher serves the store),
    ranks 1 and 2 regroup at once, rank 1 serves from the newest global model either had, the two share the data
    from the first epoch after both of theirs (recorded there, once), and rank 1 writes the results: every epoch
    once, keeping the evaluations rank 0 had written before it died."""
    run, result, said = async_run(tmp_path, 3, "train-middle@0:2")
    took = re.search(r"\[rank1\] dptrain: rank 0, which holds the global model and the merge service, is gone \("
                     r"[^)]*\): rank 1 took over in \d+\.\d s, with 2 workers \(ranks 1, 2 of the job\), from the newest "
                     r"global model "
                     r"any of them had \(version \d+, from rank [12]\); they share the data from epoch (\d+)", said)
    assert took, said
    history = records(run)
    assert [record["epoch"] for record in history] == list(range(1, 41))
    changes = [record for record in history if "membership" in record]
    assert len(changes) == 1, [record.get("membership") for record in history]
    switch = changes[0]["epoch"]
    assert switch == int(took.group(1)) and 2 < switch <= 40
    assert changes[0]["membership"]["members"] == [1, 2] and changes[0]["membership"]["left"] == [0]
    for record in history:  # rank 0's numbers of epoch 1 stay; its third of epochs 2 until the switch is not trained
        rows = [worker["samples"] for worker in record["workers"]]
        expected = [479, 479, 479] if record["epoch"] == 1 else [479, 479] if record["epoch"] < switch else [718, 719]
        assert rows == expected, (record["epoch"], rows)
    # Rank 0 wrote epoch 1 with its evaluation, which rank 1 keeps; rank 1 evaluates from the epoch it took over in
    # (the one before the switch) on. An epoch rank 1 had passed and rank 0 had not finished has none.
    assert all(record["evaluated"] and record["test_accuracy"] is not None
               for record in history if record["epoch"] == 1 or record["epoch"] >= switch - 1)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and len(summary["merges"]) == 2
    assert summary["test_accuracy"] > 0.9 and (run / "model.pt").is_file()
    assert "GLHF" not in result.stderr and "pair.cc" not in result.stderr and "Traceback" not in said


def test_after_a_take_over_the_new_service_leaves_out_the_next_lost_worker_as_the_first_did(tmp_path):
    """4 workers: rank 0 killed in epoch 2 (ranks 1, 2, 3 take over), then rank 3 in its epoch 6: the merge service
    on rank 1 leaves it out and the two left share the data from the next epoch it names. Both changes are
    recorded once, in order; rank 0's and rank 3's numbers stay in the records for the epochs each finished."""
    run, result, said = async_run(tmp_path, 4, "train-middle@0:2;train-middle@3:6")
    assert "rank 1 took over in" in said and "with 3 workers (ranks 1, 2, 3 of the job)" in said
    assert "[rank1] dptrain: the merge service left rank 3 out (its process ended); it merges over 2 workers" in said
    history = records(run)
    assert [record["epoch"] for record in history] == list(range(1, 41))
    changes = [(record["epoch"], record["membership"]) for record in history if "membership" in record]
    assert [(change["members"], change["left"]) for _, change in changes] == [([1, 2, 3], [0]), ([1, 2], [3])]
    (first, _), (second, _) = changes
    assert 2 < first < second <= 40
    for record in history:  # a quarter of 1437 rows is 359 or 360, a third 479
        epoch, rows = record["epoch"], [worker["samples"] for worker in record["workers"]]
        # rank 0 finished epoch 1, rank 3 its epochs 1 to 5
        ranks = [rank for rank, last in ((0, 1), (1, 40), (2, 40), (3, 5)) if epoch <= last]
        assert [worker["rank"] for worker in record["workers"]] == ranks, (epoch, record["workers"])
        if epoch < first:
            assert set(rows) <= {359, 360}, (epoch, rows)
        else:
            assert rows == ([479] * len(ranks) if epoch < second else [718, 719]), (epoch, rows)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["test_accuracy"] > 0.9


def test_async_cannot_go_on_without_rank_0_where_rank_0_hosts_the_store_and_says_so():
    """Without a store served beside the ranks (here: rank 0 hosts it, as under torchrun), nobody can take over."""
    results = run_distributed(_async_losing_rank_0, 3, lost=(0,))
    assert results[1] == results[2] == ("async cannot go on without rank 0, which holds the global model, where "
                                        "rank 0 also hosts the run's store: the run ends")


def _async_losing_rank_0(rank, world):
    from dptrain.runtime.group import PeerFailure
    from dptrain.strategies.asynchronous import Async
    from dptrain.train.trainer import Trainer
    from distributed import toy_data, toy_model

    class Dying(Async):
        def merge_now(self):
            if self.ctx.rank == 0:
                os._exit(0)
            time.sleep(0.5)
            return super().merge_now()

    model = toy_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy", Dying(), batch_size=16,
                      verbose=False, min_workers=2)
    try:
        trainer.fit(toy_data(), epochs=2)
    except PeerFailure as failure:
        return re.search(r"\((async cannot go on[^)]*)\)", str(failure)).group(1)
