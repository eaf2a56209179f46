"""A rank killed at any point of a checkpoint save loses no complete checkpoint: the restarted world
resumes from the newest complete one and ends with the weights of an uninterrupted run.

    make test PYTEST_ARGS="tests/test_save_faults.py --save-faults all"

runs every strategy x rank x point x --keep-checkpoints 1 and 2 (64 cases); CI runs the
default subset: every point under sync with --keep-checkpoints 1 (where a lost checkpoint cannot
hide behind an older one), on both ranks where a rank's files become visible (save-rename,
save-end) and on one rank, alternating, elsewhere; and one case of each other strategy.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from dptrain.faults import POINTS
from cli_runner import run_dptrain

pytestmark = [pytest.mark.slow]
EPOCHS, FAULT_EPOCH = 3, 2
STRATEGIES = ("allreduce", "sync", "fedavg", "async")
DIGITS = ["--dataset", "digits", "--model", "mlp", "--batch-size", "32", "--lr", "0.05", "--workers", "2",
          "--epochs", str(EPOCHS), "--no-progress"]
ONE_RANK = {"save-begin": 0, "save-fsync": 1, "train-middle": 1}  # the points where one rank is enough
SUBSET = [("sync", rank, point, 1) for point in POINTS for rank in (0, 1) if ONE_RANK.get(point, rank) == rank] + [
    ("allreduce", 1, "save-rename", 1), ("fedavg", 0, "save-end", 2), ("async", 1, "save-fsync", 1)]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        every = metafunc.config.getoption("--save-faults") == "all"
        cases = list(itertools.product(STRATEGIES, (0, 1), POINTS, (1, 2))) if every else SUBSET
        metafunc.parametrize("case", cases, ids=["-".join(map(str, case)) for case in cases])


def _train(cwd, out, keep, strategy, *extra, env=None):
    return run_dptrain(["train", *DIGITS, "--strategy", strategy, "--keep-checkpoints", str(keep), "--out", out,
                        *extra], cwd=cwd, timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """model.pt of an uninterrupted run, per strategy (the keep count does not change the result)."""
    cwd, models = tmp_path_factory.mktemp("clean"), {}

    def model(strategy):
        if strategy not in models:
            done = _train(cwd, strategy, 2, strategy)
            assert done.returncode == 0, done.stderr
            models[strategy] = (torch.load(cwd / strategy / "model.pt", weights_only=True),
                                json.loads((cwd / strategy / "summary.json").read_text())["test_accuracy"])
        return models[strategy]
    return model


def test_a_rank_killed_while_it_saves_resumes_from_the_newest_complete_checkpoint(tmp_path, case, uninterrupted):
    strategy, rank, point, keep = case
    marker = tmp_path / "fired"
    done = _train(tmp_path, "run", keep, strategy, "--max-restarts", "1",
                  env={"DPTRAIN_FAULT": f"{point}@{rank}:{FAULT_EPOCH}", "DPTRAIN_FAULT_ONCE": str(marker)})
    assert marker.exists(), "the fault point was never reached"
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"worker rank {rank} was killed by SIGKILL" in done.stderr
    resumed = [line for line in done.stdout.splitlines() if "resuming after epoch" in line]
    assert resumed, "the restarted world started over: a complete checkpoint was lost\n" + done.stdout[-2000:]
    assert int(resumed[0].split("resuming after epoch ")[1].split()[0]) in (FAULT_EPOCH - 1, FAULT_EPOCH)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(1, EPOCHS + 1))
    clean, clean_accuracy = uninterrupted(strategy)
    final = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    if strategy == "async":
        # Merge order varies from run to run, and async's checkpoints are approximate (each worker saves at its
        # own epoch end; what a worker merged after rank 0 saved is not in the saved global, and the rows no merge
        # brought in are made up at the end): on this 3-epoch run, 3 resumed runs gave 0.74, 0.80 and 0.86 test
        # accuracy against 0.80-0.81 uninterrupted (2026-12-06).
        accuracy = json.loads((tmp_path / "run" / "summary.json").read_text())["test_accuracy"]
        assert abs(accuracy - clean_accuracy) <= 0.1
    else:
        assert all(torch.equal(final[key], clean[key]) for key in clean)
