"""Gradient accumulation (`--accumulate N`, Trainer(accumulate=N)): one optimizer step every N batches.

A step of N micro-batches of b is the step of one batch of N x b (the gradient of the batch's mean), so the
run ends where the run with --batch-size N x b ends, up to float rounding; under DDP only the last micro-batch's
backward communicates, so the bytes are exactly those of the run with the big batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dptrain.errors import UserError
from dptrain.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def _fit(batch_size: int, accumulate: int) -> tuple[dict, int]:
    torch.manual_seed(0)
    x, y = torch.randn(200, 6), torch.randint(0, 3, (200,))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = []
    optimizer.register_step_post_hook(lambda *args: steps.append(1))
    Trainer(model, optimizer, batch_size=batch_size, accumulate=accumulate, shuffle="none", verbose=False,
            progress=False).fit((x, y), epochs=3)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, len(steps)


def test_four_micro_batches_of_8_train_as_one_batch_of_32():
    accumulated, steps = _fit(8, 4)
    whole, whole_steps = _fit(32, 1)
    assert steps == whole_steps == 3 * 7  # 200 rows in steps of 32 (the last of 8): 7 per epoch
    for key in whole:
        torch.testing.assert_close(accumulated[key], whole[key], rtol=1e-5, atol=1e-6)


def test_accumulate_1_is_the_step_it_always_was():
    again, _ = _fit(32, 1)
    whole, _ = _fit(32, 1)
    assert all(torch.equal(again[k], whole[k]) for k in whole)


def test_a_bad_accumulate_is_one_line():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UserError, match=r"^accumulate must be a whole number of at least 1, not 0$"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=0)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "DPTRAIN_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _train(tmp_path: Path, out: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--workers", "2",
                           "--strategy", "allreduce", "--epochs", "2", "--no-progress", "--out", out, *args],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)


def test_under_ddp_accumulation_communicates_once_per_step_and_ends_where_the_big_batch_does(tmp_path):
    small = _train(tmp_path, "small", "--batch-size", "8", "--accumulate", "4")
    big = _train(tmp_path, "big", "--batch-size", "32")
    assert small.returncode == 0 and big.returncode == 0, small.stderr + big.stderr
    assert "one optimizer step every 4 batches of 8 (--accumulate 4): a global batch of 8 x 2 workers x 4 = 64 " \
           "samples" in small.stdout
    summaries = [json.loads((tmp_path / run / "summary.json").read_text()) for run in ("small", "big")]
    assert summaries[0]["comm_bytes"] == summaries[1]["comm_bytes"]  # no all-reduce for the first 3 micro-batches
    models = [torch.load(tmp_path / run / "model.pt", weights_only=True) for run in ("small", "big")]
    for key in models[1]:
        torch.testing.assert_close(models[0][key], models[1][key], rtol=1e-4, atol=1e-5)


def test_a_step_larger_than_a_shard_is_refused_in_one_line(tmp_path):
    done = _train(tmp_path, "run", "--batch-size", "32", "--accumulate", "30")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--accumulate 30 with --batch-size 32 makes a step of 960 samples per worker, more than a worker's " \
           "shard of 718; use --accumulate 22 or fewer" in done.stderr
    assert not (tmp_path / "run").exists()
