"""--monitor and --early-stop-patience with a sharded model: best.pt is the best epoch's model gathered whole, as
model.pt is (every rank takes its part in the gather; the rank that writes the results writes it)."""

from __future__ import annotations

import json

import torch

from test_train_cli import dptrain


def test_a_sharded_run_keeps_its_best_model_whole_and_stops_early_as_an_unsharded_one(tmp_path):
    argv = ["train", "--dataset", "digits", "--epochs", "3", "--batch-size", "16", "--lr", "0.05",
            "--monitor", "test_loss", "--no-progress"]
    result = dptrain(*argv, "--workers", "4", "--shard", "hybrid", "--shard-size", "2", "--out", "run",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = tmp_path / "run"
    best = json.loads((run / "best.json").read_text())
    losses = [json.loads(line)["test_loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert best == {"epoch": losses.index(min(losses)) + 1, "metric": "test_loss", "value": min(losses)}
    kept = torch.load(run / "best.pt", weights_only=True)
    whole = torch.load(run / "model.pt", weights_only=True)
    assert {key: value.shape for key, value in kept.items()} == {key: value.shape for key, value in whole.items()}
    if best["epoch"] == 3:  # the last epoch's model is model.pt too
        assert all(torch.equal(kept[key], whole[key]) for key in whole)
    # Early stopping on the same rule as unsharded: rank 0's word, every rank stops after the same epoch.
    stopped = dptrain(*argv[:-3], "--epochs", "6", "--lr", "2.0", "--early-stop-patience", "1", "--no-progress",
                      "--workers", "2", "--shard", "full", "--out", "stopped", cwd=tmp_path)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    history = (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()
    assert "stopping early after epoch" in stopped.stdout + stopped.stderr and len(history) < 6
    assert torch.load(tmp_path / "stopped" / "best.pt", weights_only=True).keys() == \
        torch.load(tmp_path / "stopped" / "model.pt", weights_only=True).keys()
