"""--epochs raised on a finished run continues it from the checkpoint of its last epoch (as Lightning's fit with
more max_epochs from a checkpoint): its summary and model are kept under the epoch they were of, the LR schedule's
end moves to the new last epoch, and with a constant LR the run ends bitwise where one run of all the epochs ends."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "DPTRAIN_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _train(tmp_path: Path, out: str, epochs: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--workers", "2",
                           "--strategy", "sync", "--epochs", str(epochs), "--no-progress", "--out", out, *args],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_more_epochs_continue_a_finished_run_bitwise_as_one_run_and_keep_what_it_had(tmp_path):
    assert _train(tmp_path, "run", 3).returncode == 0
    run = tmp_path / "run"
    summary, model, first = (run / "summary.json").read_bytes(), (run / "model.pt").read_bytes(), _records(run)
    again = _train(tmp_path, "run", 5)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"continuing the finished run in {run.name} from epoch 3 to 5 (--epochs 5); its summary-epoch-3.json " \
           "and model-epoch-3.pt are kept; the LR schedule now ends at epoch 5" in again.stdout
    assert (run / "summary-epoch-3.json").read_bytes() == summary and (run / "model-epoch-3.pt").read_bytes() == model
    records = _records(run)
    assert [r["epoch"] for r in records] == [1, 2, 3, 4, 5] and records[:3] == first
    assert json.loads((run / "summary.json").read_text())["epochs"] == 5
    assert _train(tmp_path, "whole", 5).returncode == 0
    extended = torch.load(run / "model.pt", weights_only=True)
    whole = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    assert all(torch.equal(extended[k], whole[k]) for k in whole)


def test_the_schedules_end_moves_to_the_new_last_epoch(tmp_path):
    assert _train(tmp_path, "run", 2, "--lr-schedule", "cosine", "--lr", "0.04").returncode == 0
    assert _train(tmp_path, "run", 4, "--lr-schedule", "cosine", "--lr", "0.04").returncode == 0
    lrs = [r["lr"] for r in _records(tmp_path / "run")]
    assert lrs[1] == 0.0  # the 2-epoch run ended at the bottom of its cosine
    # after epochs 3 and 4 of a 4-epoch cosine from 0.04: 0.04 (1 + cos(3 pi / 4)) / 2, then 0
    assert lrs[2:] == pytest.approx([0.04 * (1 + math.cos(math.pi * 3 / 4)) / 2, 0.0], abs=1e-12)


def test_the_same_epochs_again_and_a_run_without_its_last_checkpoint_are_refused_in_one_line(tmp_path):
    assert _train(tmp_path, "run", 2).returncode == 0
    same = _train(tmp_path, "run", 2)
    assert same.returncode == 2 and "holds a finished run (summary.json)" in same.stderr
    assert _train(tmp_path, "bare", 2, "--checkpoint-every", "0").returncode == 0
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "bare").iterdir() if p.is_file())
    more = _train(tmp_path, "bare", 4, "--checkpoint-every", "0")
    assert more.returncode == 2 and len(more.stderr.strip().splitlines()) == 1, more.stderr
    assert "holds a finished run of 2 epochs without a checkpoint of its last epoch (it has none), so --epochs 4 " \
           "cannot continue it" in more.stderr
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "bare").iterdir() if p.is_file()) == before


def test_a_continuation_refused_by_its_checkpoint_leaves_the_finished_run_as_it_was(tmp_path):
    """The checks of the checkpoint a continuation starts from (here: the data it was written on) come before the
    finished run's summary and model are kept under their epoch: a refusal renames nothing."""
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(64, 8)).astype(np.float32), y=rng.integers(0, 3, 64))

    def train(epochs: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dptrain", "train", "--data", "d.npz", "--workers", "2",
                               "--strategy", "sync", "--batch-size", "8", "--epochs", str(epochs), "--no-progress",
                               "--out", "run"],
                              cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)

    assert train(1).returncode == 0
    run = tmp_path / "run"
    before = sorted((p.name, p.read_bytes()) for p in run.iterdir() if p.is_file())
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(64, 8)).astype(np.float32), y=rng.integers(0, 3, 64))
    more = train(2)
    assert more.returncode == 2 and len(more.stderr.strip().splitlines()) == 1, more.stderr
    assert "--resume-with-changed-data" in more.stderr and "Traceback" not in more.stderr
    assert sorted((p.name, p.read_bytes()) for p in run.iterdir() if p.is_file()) == before
