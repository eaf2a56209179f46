"""--monitor (the best model by a test metric, OUT/best.pt) and --early-stop-patience (stop after N evaluated
epochs without a better value), on a problem whose test labels are the training labels flipped: the better the
model learns the training data, the worse its test loss, so the best epoch comes early and the run stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dptrain.errors import UserError
from dptrain.train.best import Best
from dptrain.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def _history(*values, evaluated=None):
    return [{"epoch": i + 1, "test_loss": v, "test_accuracy": None if v is None else 1 - v,
             "evaluated": v is not None if evaluated is None else evaluated[i]} for i, v in enumerate(values)]


def test_the_best_is_strictly_better_and_unevaluated_epochs_count_for_nothing():
    best = Best(None, None, "test_loss", 2, print)
    assert best.best(_history(0.5, 0.4, 0.4, None, 0.45)) == (2, 0.4, 2)  # a tie is no better; epoch 4 not evaluated
    assert Best(None, None, "test_accuracy", None, print).best(_history(0.5, 0.4, 0.6)) == (2, 0.6, 1)
    assert best.best([]) == (None, None, 0)
    with pytest.raises(UserError, match="monitor 'val_loss' must be one of test_loss, test_accuracy"):
        Best(None, None, "val_loss", None, print)


def _flipped(n: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    return x, (x[:, 0] > 0).long()


def test_early_stopping_keeps_the_best_epochs_model_and_ends_as_a_finished_run(tmp_path):
    torch.manual_seed(0)
    (x, y), (xt, yt) = _flipped(256, 1), _flipped(128, 2)
    model = torch.nn.Linear(4, 2)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), batch_size=32, out=str(tmp_path / "run"),
                      monitor="test_loss", early_stop_patience=2, checkpoint_every=1, verbose=False, progress=False)
    summary = trainer.fit((x, y), (xt, 1 - yt), epochs=30)
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [record["test_loss"] for record in history]
    best_epoch = losses.index(min(losses)) + 1
    assert len(history) == best_epoch + 2 < 30 and summary.epochs == len(history)
    assert json.loads((tmp_path / "run" / "best.json").read_text()) == {"epoch": best_epoch, "metric": "test_loss",
                                                                         "value": min(losses)}
    best = torch.nn.Linear(4, 2)
    best.load_state_dict(torch.load(tmp_path / "run" / "best.pt", weights_only=True))
    with torch.no_grad():  # best.pt is the model whose test loss was recorded as the best
        assert torch.nn.functional.cross_entropy(best(xt), 1 - yt).item() == pytest.approx(min(losses), rel=1e-6)
    assert (tmp_path / "run" / "summary.json").is_file()


FACTORY = textwrap.dedent("""
    import torch
    from torch.utils.data import TensorDataset

    def make():
        g = torch.Generator().manual_seed(1)
        x, xt = torch.randn(512, 4, generator=g), torch.randn(128, 4, generator=g)
        return TensorDataset(x, (x[:, 0] > 0).long()), TensorDataset(xt, (xt[:, 0] <= 0).long())
""")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "DPTRAIN_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "flipped.py").write_text(FACTORY)
    return subprocess.run([sys.executable, "-m", "dptrain", "train", "--data", "flipped.py:make", "--workers", "2",
                           "--epochs", "30", "--lr", "0.5", "--no-progress", "--out", "run", *args],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)


def test_two_workers_stop_after_the_same_epoch_and_say_so_once(tmp_path):
    done = _train(tmp_path, "--strategy", "sync", "--early-stop-patience", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [record["test_loss"] for record in history]
    best_epoch = losses.index(min(losses)) + 1
    assert len(history) == best_epoch + 3 < 30
    assert done.stdout.count("stopping early after epoch") == 1
    assert f"stopping early after epoch {len(history)}: test_loss has not improved for 3 evaluated epochs " \
           f"(--early-stop-patience 3); the best, {min(losses):.4f}, was epoch {best_epoch}'s" in done.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["epochs"] == len(history)


def test_early_stopping_under_async_is_refused_in_one_line(tmp_path):
    done = _train(tmp_path, "--strategy", "async", "--early-stop-patience", "3")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "early stopping needs workers that meet at every epoch end, and async has none" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_a_monitor_that_is_no_test_metric_is_refused_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--out", "run",
                           "--monitor", "val_loss"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr == "dptrain: error: --monitor must be test_loss or test_accuracy " \
                                                  "(got 'val_loss')\n"
    assert not (tmp_path / "run").exists()
