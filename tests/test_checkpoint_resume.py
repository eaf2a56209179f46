"""Checkpoints are atomic and verified; an interrupted run continues exactly where it stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from dptrain.errors import UserError
from dptrain.train import checkpoint_files
from test_train_cli import DIGITS, dptrain, same_model
from cli_runner import ForkedDptrain


def _state(value: float) -> dict:
    """A rank file's state with every entry load() validates."""
    return {"epoch": 1, "step": 4, "wall_seconds": 0.5, "model": {"w": torch.full((3,), value)},
            "optimizer": {"state": {}, "param_groups": []}, "scheduler": {}, "scaler": {}, "strategy": {},
            "rng": {"torch": torch.get_rng_state()}, "history": [{"loss": value}]}


def test_latest_complete_skips_a_truncated_checkpoint_and_falls_back(tmp_path):
    for epoch in (1, 2):
        for rank in (0, 1):
            checkpoint_files.save(tmp_path, epoch, rank, _state(epoch + rank / 10))
    assert checkpoint_files.latest_complete(tmp_path, 2) == (2, [])
    newest = tmp_path / "checkpoints" / "epoch-000002" / "rank-00001.pt"
    newest.write_bytes(newest.read_bytes()[:20])  # a crash mid-write that bypassed the rename
    epoch, notes = checkpoint_files.latest_complete(tmp_path, 2)
    assert (epoch, notes) == (1, ["the checkpoint of epoch 2 is corrupt (rank file(s) [1] fail their checksum); "
                                  "continuing from epoch 1"])
    assert torch.equal(checkpoint_files.load(tmp_path, 1, 1)["model"]["w"], torch.full((3,), 1.1))
    with pytest.raises(UserError, match="does not match its checksum"):
        checkpoint_files.load(tmp_path, 2, 1)


def test_missing_rank_file_makes_a_checkpoint_incomplete(tmp_path):
    checkpoint_files.save(tmp_path, 1, 0, _state(1.0))
    assert checkpoint_files.latest_complete(tmp_path, 2) == (None, ["the checkpoint of epoch 1 was not finished; "
                                                              "starting the run over"])
    assert checkpoint_files.latest_complete(tmp_path, 1)[0] == 1


def test_a_save_cut_short_by_an_interrupt_is_expected_not_corrupt(tmp_path):
    for rank in (0, 1):
        checkpoint_files.save(tmp_path, 2, rank, _state(2.0))
    checkpoint_files.save(tmp_path, 3, 0, _state(3.0))  # Ctrl-C came while rank 1 was writing epoch 3
    assert checkpoint_files.latest_complete(tmp_path, 2) == (2, ["the checkpoint of epoch 3 was not finished; "
                                                           "continuing from epoch 2"])


def test_prune_keeps_the_newest(tmp_path):
    for epoch in range(1, 6):
        checkpoint_files.save(tmp_path, epoch, 0, _state(epoch))
    checkpoint_files.prune(tmp_path, keep=2, world_size=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch-000004", "epoch-000005"]


class NotATensor:
    pass


def test_checkpoints_are_loaded_without_unpickling_objects(tmp_path):
    state = _state(1.0)
    state["evil"] = NotATensor()
    checkpoint_files.save(tmp_path, 1, 0, state)  # valid checksum, forbidden content
    with pytest.raises(UserError, match="cannot be read"):
        checkpoint_files.load(tmp_path, 1, 0)


ONCE_FAILING_MODEL = """
import os, signal
from pathlib import Path
from torch import nn

class Net(nn.Module):
    def __init__(self, input_shape, num_outputs):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(32, num_outputs))
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            marker = Path(os.environ.get("FAIL_MARKER", "/nonexistent/marker"))
            # rank 1 dies in the middle of epoch 3 of the first attempt only
            if os.environ.get("RANK") == "1" and self.calls == 51 and marker.parent.is_dir() and not marker.exists():
                marker.write_text("failed once")
                os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)

def make(input_shape, num_outputs):
    return Net(input_shape, num_outputs)
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sync"])  # one strategy keeps the suite short: all share _checkpoint/_restore
def test_a_restart_after_a_killed_worker_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path, strategy):
    (tmp_path / "once_failing.py").write_text(textwrap.dedent(ONCE_FAILING_MODEL))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    args = ["train", *DIGITS, "--epochs", "5", "--model", "once_failing:make", "--strategy", strategy]
    clean = dptrain(*args, "--out", "clean", cwd=tmp_path, env=env)
    assert clean.returncode == 0, clean.stderr
    restarted = dptrain(*args, "--max-restarts", "2", "--out", "restarted", cwd=tmp_path,
                        env={**env, "FAIL_MARKER": str(tmp_path / "marker")})
    assert restarted.returncode == 0, restarted.stderr
    assert "worker rank 1 was killed by SIGKILL" in restarted.stderr
    assert "restarting the 2 workers from the last checkpoint (restart 1 of 2)" in restarted.stderr
    assert "resuming after epoch 2" in restarted.stdout
    assert same_model(tmp_path / "clean", tmp_path / "restarted")
    records = [json.loads(line) for line in (tmp_path / "restarted" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3, 4, 5]  # the lost attempt's epoch 3 is not recorded twice


@pytest.mark.slow
def test_sigterm_checkpoints_and_stops_then_the_same_command_continues(tmp_path):
    args = ["train", *DIGITS, "--epochs", "25", "--strategy", "sync", "--out", "run"]
    proc = ForkedDptrain(args, cwd=tmp_path)
    first_checkpoint = tmp_path / "run" / "checkpoints"
    deadline = time.monotonic() + 120
    while not first_checkpoint.is_dir() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # what SLURM sends before the time limit
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr
    assert "stopped by SIGTERM" in stderr and "run the same command again" in stderr
    stopped_at = len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    assert 1 <= stopped_at < 25
    assert checkpoint_files.latest_complete(tmp_path / "run", 2)[0] == stopped_at
    again = dptrain(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"resuming after epoch {stopped_at}" in again.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["epochs"] == 25 and summary["test_accuracy"] >= 0.9
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(1, 26))


def test_a_stop_signal_during_start_up_ends_the_run_at_its_first_epoch_with_a_checkpoint(tmp_path):
    # SIGUSR1 lands before any Trainer exists (as when a rank is still importing or meeting its
    # peers): it must not kill the rank; the run stops cleanly after epoch 1 and can continue.
    script = textwrap.dedent(f"""
        import os, signal, sys
        from dptrain.cli import main
        from dptrain.train.preemption import catch_stop_signals_early
        catch_stop_signals_early()
        os.kill(os.getpid(), signal.SIGUSR1)
        sys.exit(main(["train", *{DIGITS!r}, "--epochs", "4", "--workers", "1", "--out", "run"]))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 75, done.stderr
    assert "stopped by SIGUSR1 after epoch 1" in done.stderr
    assert checkpoint_files.latest_complete(tmp_path / "run", 1)[0] == 1


@pytest.mark.slow
def test_a_run_that_died_after_its_last_checkpoint_finishes_on_the_next_attempt(tmp_path):
    # Found by the fault-injection harness: the resumed attempt trains no epoch at all.
    args = ["train", *DIGITS, "--epochs", "3", "--strategy", "sync", "--out", "run"]
    first = dptrain(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for name in ("summary.json", "model.pt"):  # as if killed between the last checkpoint and the end
        (tmp_path / "run" / name).unlink()
    again = dptrain(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "resuming after epoch 3" in again.stdout
    resumed = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert resumed["test_accuracy"] == summary["test_accuracy"] and resumed["epochs"] == 3


def test_cuda_random_state_is_this_ranks_gpu_only_and_a_resume_seeing_fewer_gpus_restores_it(monkeypatch):
    """get_rng_state_all() saved every visible GPU's stream and set_rng_state_all() restored them all: a resume
    under srun --gpus-per-task=1 (one GPU visible) raised IndexError, and a rank whose GPU index changed took
    another GPU's stream. Now a checkpoint holds the rank's own GPU's state and restores it to the rank's GPU."""
    import torch

    from dptrain.train import checkpoint_files

    streams = {0: torch.tensor([1], dtype=torch.uint8), 1: torch.tensor([2], dtype=torch.uint8)}
    restored = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: streams[device].clone())
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [streams[0], streams[1]])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.update({device: state}))

    def set_all(states):  # what torch does with more states than visible GPUs after the resume
        raise IndexError("list index out of range")
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    state = checkpoint_files.rng_state()
    assert torch.equal(state["cuda_device"], streams[1]) and "cuda" not in state
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # resumed where the rank sees one GPU
    checkpoint_files.set_rng_state(state)
    assert list(restored) == [0] and torch.equal(restored[0], streams[1])
    restored.clear()
    checkpoint_files.set_rng_state({**{k: v for k, v in state.items() if k != "cuda_device"},
                                    "cuda": [streams[0], streams[1]]})  # an older checkpoint: every GPU's
    assert list(restored) == [0] and torch.equal(restored[0], streams[0])
