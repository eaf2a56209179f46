"""Checkpoints within an epoch (--checkpoint-every-steps): a run killed between them continues bit for bit."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from distributed import run_distributed
from dptrain import faults
from dptrain.data.sampler import EpochPlan, PlanBatches
from dptrain.errors import Preempted, UserError
from dptrain.train import checkpoint_files
from test_checkpoint_resume import _state
from test_train_cli import dptrain, same_model

EVERY, EPOCHS, ROWS, BATCH = 3, 2, 1024, 64  # 8 steps per epoch on each of 2 ranks: checkpoints at 3 and 6


def test_checkpoints_within_an_epoch_sort_between_its_ends_and_old_ones_still_load(tmp_path):
    for at in (1, (1, 3), (1, 6), 2, (2, 3)):
        for rank in (0, 1):
            checkpoint_files.save(tmp_path, at, rank, _state(1.0))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "epoch-000001", "epoch-000001-step-000003", "epoch-000001-step-000006", "epoch-000002",
        "epoch-000002-step-000003"]
    assert checkpoint_files.latest_complete(tmp_path, 2) == ((2, 3), [])
    (tmp_path / "checkpoints" / "epoch-000002-step-000003" / "rank-00001.pt").unlink()
    assert checkpoint_files.latest_complete(tmp_path, 2) == (
        2, ["the checkpoint of step 3 of epoch 3 was not finished; continuing from epoch 2"])
    checkpoint_files.prune(tmp_path, 2, 2)  # the unfinished newer one stays; epoch 1 and (1, 3) go
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "epoch-000001-step-000006", "epoch-000002", "epoch-000002-step-000003"]
    assert checkpoint_files.load(tmp_path, 2, 0)["epoch"] == 1  # an epoch end's file, no position: as before


def test_every_random_generator_is_saved_and_restored():
    state = checkpoint_files.rng_state()
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    checkpoint_files.set_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], again[0]) and np.array_equal(drawn[1], again[1]) and drawn[2] == again[2]
    checkpoint_files.set_rng_state({"torch": state["torch"]})  # a checkpoint written before numpy's was kept


def test_a_plan_resumed_at_a_step_reads_only_the_rest_of_the_epoch():
    plan = EpochPlan(4, lambda epoch: np.arange(8) + 100 * epoch)
    batches = PlanBatches(plan)
    batches.set_epoch(1, 3)
    assert len(batches) == 1 and list(batches) == [[106, 107]]
    batches.set_epoch(2)
    assert len(batches) == 4 and list(batches)[0] == [200, 201]


@pytest.mark.parametrize("strategy", ["async", "streaming"])
def test_strategies_without_a_common_step_refuse_it_in_one_sentence(strategy, capsys, monkeypatch, tmp_path):
    from dptrain import cli
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPTRAIN_DEBUG", "0")
    code = cli.main(["train", "--dataset", "digits", "--strategy", strategy, "--checkpoint-every-steps", "5"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"dptrain: error: invalid settings in the command line: --checkpoint-every-steps "
                               f"does not apply to strategy {strategy}: its ")
    assert lines[0].endswith("; it checkpoints at epoch ends (--checkpoint-every)")
    assert list(tmp_path.iterdir()) == []


def test_a_step_fault_names_its_form_when_misspelt(monkeypatch):
    monkeypatch.setenv("DPTRAIN_FAULT", "stepp@1:3")
    with pytest.raises(ValueError, match=r"or step@RANK:STEP\)$"):
        faults.step(1, 3)


class _Killed(Exception):
    """What the in-process 'kill' raises on every rank after one step (a real SIGKILL is the CLI test's)."""


def _digits():
    from dptrain.data.sources import _digits_arrays
    x, y = _digits_arrays()
    return x[:ROWS], y[:ROWS]


def _model():
    torch.manual_seed(3)  # dropout draws from torch's RNG: the checkpoint must carry it
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 10))


def _fit(strategy_name: str, out, resume: bool = False, every_steps: int = 0, made=lambda trainer: None):
    from dptrain.strategies import AllReduce, FedAvg, Sync
    from dptrain.train.trainer import Trainer
    strategy = {"allreduce": AllReduce, "sync": Sync, "fedavg": FedAvg}[strategy_name]()
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), "cross-entropy", strategy,
                      batch_size=BATCH, seed=1, verbose=False, progress=False, out=out, checkpoint_every=0,
                      checkpoint_every_steps=every_steps, resume=resume)
    made(trainer)
    trainer.fit(_digits(), epochs=EPOCHS)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, trainer.history


def _killed_and_resumed(rank, world, root, kills, signal_step):
    """Per strategy: a run without step checkpoints, and one killed after step `kills[strategy]` and resumed;
    then sync stopped by a signal (_stopped_and_resumed)."""
    results = {}
    from dptrain.strategies import Async
    from dptrain.train.trainer import Trainer
    model = _model()
    with pytest.raises(UserError) as refused:  # what the config refuses, refused from Python too (or after auto)
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), strategy=Async(), checkpoint_every_steps=2,
                verbose=False, progress=False).fit(_digits())
    results["async"] = str(refused.value)
    for name, kill in kills.items():
        clean = _fit(name, None)

        def die(at_rank, step, kill=kill):
            if step == kill:
                raise _Killed

        real_step, faults.step = faults.step, die
        try:
            with pytest.raises(_Killed):
                _fit(name, f"{root}/{name}", every_steps=EVERY)
        finally:
            faults.step = real_step
        torch.distributed.barrier()  # a killed world's files are all written before it restarts
        saved = checkpoint_files.latest_complete(f"{root}/{name}", world)[0]
        results[name] = (clean, _fit(name, f"{root}/{name}", resume=True, every_steps=EVERY), saved)
    return results, _stopped_and_resumed(f"{root}/stopped", signal_step, results["sync"][0][0])


def _stopped_and_resumed(root, signal_step, clean):
    """sync with SIGTERM on rank 0 after step `signal_step`: (stop message, checkpoint it left, clean model,
    resumed model)."""
    trainers = []

    def signal_here(at_rank, step):
        if step == signal_step and at_rank == 0:
            trainers[0].stop_signals.requested = "SIGTERM"

    real_step, faults.step = faults.step, signal_here
    try:
        with pytest.raises(Preempted) as stopped:
            _fit("sync", root, every_steps=EVERY, made=trainers.append)
    finally:
        faults.step = real_step
    saved = checkpoint_files.latest_complete(root, 2)[0]
    return str(stopped.value), saved, clean, _fit("sync", root, resume=True, every_steps=EVERY)[0]


# A random step of the run for each strategy (reproducible: seeded); SIGTERM after step 10 (epoch 2, step 2).
KILLS = {name: random.Random(2312 + i).randrange(EVERY + 1, EPOCHS * ROWS // 2 // BATCH)
         for i, name in enumerate(("allreduce", "sync", "fedavg"))}
SIGNAL_STEP = 10


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """What each rank of _killed_and_resumed returned (one pair of processes for both tests below)."""
    root = tmp_path_factory.mktemp("interrupted")
    return root, run_distributed(_killed_and_resumed, 2, str(root), KILLS, SIGNAL_STEP, timeout=240)


def test_a_run_killed_mid_epoch_ends_bitwise_equal_to_an_uninterrupted_one(interrupted):
    kills, steps = KILLS, ROWS // 2 // BATCH
    for rank, (results, _) in enumerate(interrupted[1]):
        assert results.pop("async") == (
            "checkpoint_every_steps does not apply to strategy async: its workers never stand at the same step (no "
            "barrier) and merges are in flight between them, so files written within an epoch are no one state of "
            "the run; it checkpoints at epoch ends (checkpoint_every)")
        for name, ((clean, clean_history), (resumed, history), saved) in results.items():
            # The last checkpoint before the kill: steps 3 and 6 of each epoch (the kill comes before a save).
            last = max(g for g in range(1, kills[name]) if (g - 1) % steps + 1 in (EVERY, 2 * EVERY))
            assert saved == ((last - 1) // steps, (last - 1) % steps + 1), (name, kills[name])
            assert resumed.keys() == clean.keys()
            assert all(torch.equal(resumed[key], clean[key]) for key in clean), f"{name}, rank {rank}"
            assert [r["train_loss"] for r in history] == [r["train_loss"] for r in clean_history], name


def test_a_stop_signal_mid_epoch_checkpoints_at_the_next_step_checkpoint_and_the_run_continues(interrupted):
    # SIGTERM on rank 0 after step 10 (epoch 2, step 2): every rank stops after step 11, at the checkpoint at
    # step 3 of epoch 2, not at the epoch's end.
    root, ranks = interrupted
    for rank, (_, (said, saved, clean, resumed)) in enumerate(ranks):
        signal = "SIGTERM" if rank == 0 else "a signal to another rank"
        assert said == (f"rank {rank}: stopped by {signal} at step 3 of epoch 2; a checkpoint is saved in "
                        f"{root}/stopped: run the same command again to continue")
        assert saved == (1, 3)
        assert all(torch.equal(resumed[key], clean[key]) for key in clean)


DIGITS2 = ["--dataset", "digits", "--model", "mlp", "--batch-size", "32", "--lr", "0.05", "--workers", "2",
           "--epochs", "2", "--no-progress"]


@pytest.mark.slow
def test_a_worker_killed_by_sigkill_mid_epoch_restarts_from_its_step_checkpoint(tmp_path):
    clean = dptrain("train", *DIGITS2, "--strategy", "fedavg", "--out", "clean", cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr
    killed = dptrain("train", *DIGITS2, "--strategy", "fedavg", "--checkpoint-every-steps", "4", "--max-restarts",
                     "1", "--out", "killed", cwd=tmp_path,
                     env={"DPTRAIN_FAULT": "step@1:30", "DPTRAIN_FAULT_ONCE": str(tmp_path / "fired")})
    assert killed.returncode == 0, killed.stderr
    assert "worker rank 1 was killed by SIGKILL" in killed.stderr
    assert "resuming at step 4 of epoch 2 from" in killed.stdout
    assert same_model(tmp_path / "clean", tmp_path / "killed")
    records = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]


def test_train_middle_still_fires_in_an_epoch_that_had_a_checkpoint_within_it(tmp_path):
    """A checkpoint within an epoch reset the fault points' epoch, so train-middle@R:E never fired in an epoch with
    --checkpoint-every-steps checkpoints before its middle (tests had to use step@ instead)."""
    import os
    import subprocess
    import sys

    marker = tmp_path / "fired"
    env = {**os.environ, "DPTRAIN_FAULT": "train-middle@1:2", "DPTRAIN_FAULT_ONCE": str(marker)}
    done = subprocess.run([sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--model", "mlp",
                           "--strategy", "sync", "--workers", "2", "--epochs", "3", "--checkpoint-every-steps", "3",
                           "--max-restarts", "1", "--no-progress", "--out", str(tmp_path / "run")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert marker.exists(), done.stderr[-2000:]
    assert done.returncode == 0 and "worker rank 1 was killed by SIGKILL" in done.stderr, done.stderr[-2000:]
