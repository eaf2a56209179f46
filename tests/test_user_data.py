"""`--data package.module:factory`: a user's own torch Datasets through the CLI, under every strategy."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from cli_runner import run_dptrain

MODULE = textwrap.dedent("""
    import os

    import numpy as np
    import torch
    from sklearn.datasets import load_digits


    class Digits(torch.utils.data.Dataset):
        def __init__(self, x, y):
            self.x, self.y = x, y

        def __len__(self):
            return len(self.x)

        def __getitem__(self, index):
            return torch.from_numpy(self.x[index]), int(self.y[index])


    def _arrays():
        digits = load_digits()
        return (digits.images / 16.0).astype(np.float32), digits.target


    def make():
        x, y = _arrays()
        return Digits(x[:1400], y[:1400]), Digits(x[1400:], y[1400:])


    def train_only():
        return Digits(*_arrays())


    def not_datasets():
        return 3, None


    class Singles(Digits):
        def __getitem__(self, index):
            return self.x[index]


    def single_items():
        return Singles(*_arrays()), None


    class Corrupt(Digits):
        def __init__(self, x, y, targets):
            super().__init__(x, y)
            if targets:
                self.targets = y
            self.anywhere = not targets  # with targets: fails only as a worker reads it (a file that went bad)

        def __getitem__(self, index):
            if index == 700 and (self.anywhere or "RANK" in os.environ):  # the launcher reads every item once
                raise ValueError("cannot decode image 700.png")
            return super().__getitem__(index)


    def corrupt_item(targets=True):
        x, y = _arrays()
        return Corrupt(x[:1400], y[:1400], targets), Digits(x[1400:], y[1400:])


    def corrupt_unlabelled():
        return corrupt_item(targets=False)
""")
ARGS = ["train", "--model", "mlp", "--epochs", "3", "--workers", "2", "--no-progress",
        "--lr", "0.05"]  # the accuracy thresholds were set at this LR (the default before issue 20)


def _dptrain(tmp_path, *args):
    (tmp_path / "mydata.py").write_text(MODULE)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return run_dptrain(args, cwd=tmp_path, env=env)


@pytest.mark.parametrize("strategy", ["allreduce", "sync", "async", "fedavg"])
def test_a_user_data_factory_trains_under_every_strategy(tmp_path, strategy):
    done = _dptrain(tmp_path, *ARGS, "--data", "mydata:make", "--strategy", strategy, "--out", "run")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["test_accuracy"] >= 0.75
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(w["samples"] for w in records[0]["workers"]) == 1400  # every training sample, once


def test_a_factory_without_a_test_set_gets_a_held_out_split_said_once(tmp_path):
    done = _dptrain(tmp_path, *ARGS, "--data", "mydata:train_only", "--out", "run")
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if "holding out" in line]
    assert said == ["dptrain: mydata:train_only gave no test set: holding out 359 of its 1797 samples "
                    "(20%, chosen by the seed) for testing"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(w["samples"] for w in records[0]["workers"]) == 1797 - 359


@pytest.mark.parametrize("factory, message", [
    ("mydata:nothing", "module 'mydata' has no attribute 'nothing' for --data mydata:nothing; its public "
                       "callables are: Corrupt, Digits, Singles, corrupt_item, corrupt_unlabelled, load_digits, make, "
                       "not_datasets, single_items, train_only"),
    ("mydata:not_datasets", "data factory mydata:not_datasets returned a value of type int as its train set; return (train, "
                            "test) map-style Datasets (test may be None)"),
    ("mydata:single_items", "item 0 of the training Dataset is of type ndarray; each item must be an (x, y) pair"),
    ("mydata:corrupt_unlabelled", "item 700 of the training Dataset raised ValueError: cannot decode image 700.png"),
])
def test_a_bad_data_factory_is_one_line_and_exit_2(tmp_path, factory, message):
    done = _dptrain(tmp_path, *ARGS, "--data", factory, "--out", "run")
    assert done.returncode == 2
    assert done.stderr.strip() == f"dptrain: error: {message}"
    assert not (tmp_path / "run").exists()


def test_an_item_that_fails_during_training_is_named_in_one_line_by_its_rank(tmp_path):
    done = _dptrain(tmp_path, *ARGS, "--data", "mydata:corrupt_item", "--out", "run")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "] dptrain: error: item 700 of the training Dataset raised ValueError: cannot decode image 700.png" \
        in done.stderr
    assert (tmp_path / "run" / "config.yaml").exists()  # the run directory is kept as it was
