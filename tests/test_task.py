"""What a data set's labels make of the run: integer labels classify, float targets regress (said
in one line), `--task classify|regress` overrides the guess; the automatic test split is said."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from dptrain.train.trainer import make_loss
from cli_runner import run_dptrain

ARGS = ["train", "--model", "mlp", "--epochs", "2", "--workers", "1", "--no-progress", "--checkpoint-every", "0",
        "--lr", "0.05"]  # the accuracy thresholds were set at this LR (the default before issue 20)


def _dptrain(tmp_path, *args):
    return run_dptrain(args, cwd=tmp_path, env=os.environ.copy())


def _digits(tmp_path, labels: str) -> str:
    """digits as an .npz with no test arrays, labels stored as int64, whole floats or fractions."""
    bunch = load_digits()
    y = {"int": bunch.target.astype(np.int64), "float": bunch.target.astype(np.float32),
         "fraction": bunch.target.astype(np.float32) + 0.5}[labels]
    path = tmp_path / f"digits-{labels}.npz"
    np.savez(path, x=(bunch.data / 16.0).astype(np.float32), y=y)
    return path.name


def _summary(tmp_path) -> dict:
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def test_float_labels_are_announced_as_regression_and_the_split_is_said(tmp_path):
    data = _digits(tmp_path, "float")
    done = _dptrain(tmp_path, *ARGS, "--data", data, "--out", "run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"dptrain: y of '{data}' is float32: treating this as regression (loss mse unless --loss names one); " \
           "save integer labels (or give --task classify) for classification" in lines
    assert f"dptrain: '{data}' has no x_test/y_test: holding out 359 of its 1797 samples (20%, chosen by the " \
           "seed) for testing" in lines
    summary = _summary(tmp_path)
    assert summary["test_accuracy"] is None and summary["test_loss"] > 0


def test_task_classify_trains_float_labels_as_classes(tmp_path):
    done = _dptrain(tmp_path, *ARGS, "--data", _digits(tmp_path, "float"), "--task", "classify", "--out", "run")
    assert done.returncode == 0, done.stderr
    assert "treating this as regression" not in done.stdout
    assert _summary(tmp_path)["test_accuracy"] >= 0.8  # 10 classes learnt: far above chance


def test_integer_labels_classify_without_a_word_and_regress_on_request(tmp_path):
    data = _digits(tmp_path, "int")
    done = _dptrain(tmp_path, *ARGS, "--data", data, "--out", "run")
    assert done.returncode == 0 and "treating" not in done.stdout
    assert _summary(tmp_path)["test_accuracy"] >= 0.8
    done = _dptrain(tmp_path, *ARGS, "--data", data, "--task", "regress", "--model", "mlp-regression", "--out", "reg")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "reg" / "summary.json").read_text())
    assert summary["test_accuracy"] is None and summary["test_loss"] > 0


@pytest.mark.parametrize("args, message", [
    (["--task", "classify"], "--task classify: array 'y' in 'digits-fraction.npz' holds the label 0.5, which is "
                             "not a whole number; class labels must be 0..C-1"),
    (["--task", "guess"], "--task must be one of auto, classify, regress (got 'guess')"),
])
def test_bad_task_requests_are_one_line(tmp_path, args, message):
    done = _dptrain(tmp_path, *ARGS, "--data", _digits(tmp_path, "fraction"), *args, "--out", "run")
    assert done.returncode == 2
    assert done.stderr.strip() == f"dptrain: error: {message}"
    assert not (tmp_path / "run").exists()


def test_task_on_a_built_in_data_set_is_refused(tmp_path):
    done = _dptrain(tmp_path, *ARGS, "--dataset", "digits", "--task", "regress", "--out", "run")
    assert done.returncode == 2
    assert done.stderr.strip() == "dptrain: error: --task applies to your own --data, not --dataset digits"


def test_built_in_losses_cast_targets_and_leave_soft_targets_alone():
    output = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0]])
    cross_entropy = make_loss("cross-entropy")
    assert torch.equal(cross_entropy(output, torch.tensor([0.0, 2.0])), cross_entropy(output, torch.tensor([0, 2])))
    soft = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    assert torch.equal(cross_entropy(output, soft), torch.nn.functional.cross_entropy(output, soft))
    mse = make_loss("mse")
    assert torch.equal(mse(output[:, :1], torch.tensor([1, 2])), mse(output[:, :1], torch.tensor([1.0, 2.0])))


FACTORY = '''
import torch


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n, label):
        self.n, self.label = n, label

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return torch.full((4,), float(index)), self.label(index)


def floats():
    return Pairs(40, lambda i: float(i % 3)), Pairs(10, lambda i: float(i % 3))
'''


def test_a_factory_with_float_targets_is_announced_and_classify_counts_its_classes(tmp_path, monkeypatch):
    from dptrain.data.user import load_user_data
    (tmp_path / "floaty.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    said: list[str] = []
    data = load_user_data("floaty:floats", seed=0, log=said.append)
    assert data.task == "regression" and data.num_outputs == 1
    assert said == ["dptrain: y of floaty:floats is float64: treating this as regression (loss mse unless --loss "
                    "names one); save integer labels (or give --task classify) for classification"]
    said.clear()
    data = load_user_data("floaty:floats", seed=0, log=said.append, task="classify")
    assert data.task == "classification" and data.num_classes == 3

