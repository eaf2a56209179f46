"""Frictions a newcomer met training on their own data (issue 24), each refused in one line, exit code 2,
before anything is written, or no longer refused where nothing was wrong.

Everything runs in-process through `dptrain.cli.main` with one worker and tiny data (no workers are spawned).
"""

from __future__ import annotations

import fcntl
import json
import random
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dptrain.cli import main

FACTORIES = textwrap.dedent('''
    import math
    from pathlib import Path

    import torch
    from torch.utils.data import TensorDataset


    def _pairs(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 4, generator=g), torch.arange(n) % 2


    def nan_in_test():
        x, y = _pairs(40, 0)
        x_test, y_test = _pairs(10, 1)
        x_test[3, 1] = float("nan")
        return TensorDataset(x, y), TensorDataset(x_test, y_test)


    def inf_in_train_targets():
        x, _ = _pairs(40, 0)
        y = torch.rand(40, generator=torch.Generator().manual_seed(2))
        y[7] = float("inf")
        y[9] = float("nan")
        return TensorDataset(x, y), None


    def float_labels():
        x, y = _pairs(40, 0)
        return TensorDataset(x, y.float()), None


    def counted():
        Path("factory-called").write_text("yes")  # the tests of the order of checks look for it
        return TensorDataset(*_pairs(40, 0)), None


    def two_outputs(input_shape, num_outputs):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), 2))
''')


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A working directory holding the factories (user.py) and a good tiny.npz."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPTRAIN_DEBUG", "0")
    (tmp_path / "user.py").write_text(FACTORIES)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "tiny.npz", x=rng.standard_normal((40, 4)).astype(np.float32), y=np.arange(40) % 2)
    return tmp_path


def train(data: str, *extra: str, out: str = "out") -> list[str]:
    return ["train", "--data", data, "--workers", "1", "--epochs", "1", "--batch-size", "4", "--out", out, *extra]


def refused(argv: list[str], capsys) -> str:
    """The one line `dptrain` refused `argv` with (exit code 2, nothing on stdout after it)."""
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dptrain: error: "), captured.err
    return lines[0].removeprefix("dptrain: error: ")


# ------------------------------------------------------------------ 1. NaN in a factory's Datasets


def test_nan_in_a_factorys_test_set_is_refused_before_anything_is_written(sandbox, capsys):
    assert refused(train("user.py:nan_in_test"), capsys) == (
        "--data user.py:nan_in_test: item 3 of the test Dataset holds NaN or infinite values in its x (the input); "
        "remove or replace them in the data (or in the factory) and run again")
    assert not (sandbox / "out").exists()


def test_nan_in_a_factorys_training_targets_names_the_users_own_item_before_the_hold_out(sandbox, capsys):
    assert refused(train("user.py:inf_in_train_targets"), capsys) == (
        "--data user.py:inf_in_train_targets: item 7 of the training Dataset holds NaN or infinite values in its "
        "y (the label) (2 of its 40 items do); remove or replace them in the data (or in the factory) and run again")
    assert not (sandbox / "out").exists()


def test_the_check_of_values_leaves_the_random_state_as_it_was():
    """A Dataset that draws random numbers as it is read draws the same in training, checked or not."""
    from dptrain.data.sampler import CheckedItems
    from dptrain.data.user import check_finite

    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, index):
            return torch.rand(2) + np.random.rand() + random.random(), index % 2

    np.random.seed(1), random.seed(1), torch.manual_seed(1)
    expected = np.random.rand(), random.random(), torch.rand(1)
    np.random.seed(1), random.seed(1), torch.manual_seed(1)
    labels = check_finite(CheckedItems(Noisy(), "training"), "noisy")
    assert [int(label) for label in labels] == [0, 1, 0, 1, 0]
    assert (np.random.rand(), random.random(), torch.rand(1)) == expected
    # targets of many values are not kept (they could be as large as the data)
    pairs = torch.utils.data.TensorDataset(torch.zeros(3, 2), torch.zeros(3, 4))
    assert check_finite(CheckedItems(pairs, "training"), "pairs") is None


def test_run_files_write_nan_and_infinity_as_null(tmp_path):
    from dptrain.io import append_jsonl, to_json, write_json

    record = {"test_loss": float("nan"), "workers": [{"train_loss": float("inf")}], "pair": (float("-inf"), 1.5)}
    assert to_json(record) == '{"test_loss": null, "workers": [{"train_loss": null}], "pair": [null, 1.5]}'
    write_json(tmp_path / "summary.json", record)
    append_jsonl(tmp_path / "metrics.jsonl", record)

    def strict(constant):
        raise AssertionError(f"{constant} is not JSON")

    assert json.loads((tmp_path / "summary.json").read_text(), parse_constant=strict)["test_loss"] is None
    assert json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=strict)["pair"] == [None, 1.5]


def test_a_run_that_recorded_nothing_does_not_refuse_the_rerun_with_fixed_data(sandbox):
    """A run that failed before its first epoch left its config.yaml (other data): the rerun takes the directory."""
    from dptrain.config import build_config, to_yaml

    out = sandbox / "out"
    out.mkdir()
    (out / ".dptrain-run").write_text("a dptrain run directory\n")
    (out / "config.yaml").write_text(to_yaml(build_config({"data": str(sandbox / "broken.npz"), "out": "out"})))
    from dptrain.train.command import prepare_run_dir

    config = build_config({"data": "tiny.npz", "out": "out", "workers": 1})
    assert prepare_run_dir(config, "out", 1, torch.nn.Linear(4, 2)) == (Path("out"), False)  # a new run, not a refusal
    assert yaml.safe_load((out / "config.yaml").read_text())["data"] == str(sandbox / "tiny.npz")
    assert sorted(path.name for path in out.iterdir()) == [".dptrain-run", "config.yaml"]


def test_a_run_that_recorded_an_epoch_is_still_kept(sandbox, capsys):
    from dptrain.config import build_config, to_yaml

    out = sandbox / "out"
    out.mkdir()
    (out / ".dptrain-run").write_text("a dptrain run directory\n")
    (out / "config.yaml").write_text(to_yaml(build_config({"data": str(sandbox / "broken.npz"), "out": "out"})))
    (out / "metrics.jsonl").write_text('{"epoch": 1}\n')
    assert refused(train("tiny.npz"), capsys) == (
        f"run directory 'out' holds a run with other settings (data: '{sandbox / 'broken.npz'}' there, "
        f"'{sandbox / 'tiny.npz'}' now); give --out a new directory, or the same settings to continue it")


# ------------------------------------------------------------------ 2. folders that are not data

FORMS = ("--data DIR takes a folder of images with one subfolder per class (DIR/CLASS/IMAGE.png, or "
         "DIR/train/CLASS/... and DIR/test/CLASS/...) or a folder holding x.npy and y.npy.")
SUFFIXES = ".bmp, .gif, .jpeg, .jpg, .pgm, .png, .ppm, .tif, .tiff, .webp"


def _empty(root: Path) -> str:
    (root / "data").mkdir()
    return f"data directory 'data' is empty; {FORMS}"


def _class_folders_without_images(root: Path) -> str:
    for name in ("cat", "dog"):
        (root / "data" / name).mkdir(parents=True)
    (root / "data" / "dog" / "notes.txt").write_text("x")
    return (f"data directory 'data' looks like an image folder, but its class subfolders hold no images "
            f"({SUFFIXES}): cat, dog; {FORMS}")


def _train_test_without_images(root: Path) -> str:
    for name in ("train/cat", "test/cat"):
        (root / "data" / name).mkdir(parents=True)
    return (f"data directory 'data' (its train/ subfolder) looks like an image folder, but its class subfolders "
            f"hold no images ({SUFFIXES}): cat; {FORMS}")


def _other_files(root: Path) -> str:
    (root / "data").mkdir()
    (root / "data" / "table.csv").write_text("1,2\n")
    return f"data directory 'data' holds neither class subfolders of images nor x.npy and y.npy (it holds: table.csv); {FORMS}"


def _one_class_folder_empty(root: Path) -> str:
    from PIL import Image

    for name in ("ant", "bee", "cat"):
        (root / "data" / name).mkdir(parents=True)
    for i in range(3):
        for name in ("ant", "cat"):
            Image.new("RGB", (4, 4), (i, 0, 0)).save(root / "data" / name / f"{i}.png")
    return (f"image folder 'data' has class subfolder without images (bee); put each class's images ({SUFFIXES}) "
            "in its subfolder, or remove the subfolders of classes you do not use")


@pytest.mark.parametrize("make", [_empty, _class_folders_without_images, _train_test_without_images, _other_files,
                                  _one_class_folder_empty])
def test_a_folder_that_is_not_data_says_what_it_was_read_as_and_the_valid_forms(sandbox, capsys, make):
    expected = make(sandbox)
    assert refused(train("data"), capsys) == expected
    assert not (sandbox / "out").exists()


# ------------------------------------------------------------------ 4. a model's outputs and --task


def test_float_labels_and_a_model_of_two_outputs_name_the_task_option(sandbox, capsys):
    line = refused(train("user.py:float_labels", "--model", "user.py:two_outputs"), capsys)
    assert line == ("model output shape (2, 2) does not match the data: expected (2, 1) for 1 outputs; the data was "
                    "read as regression with 1 target value per sample (floating-point labels, or --task regress); "
                    "if its labels are classes, give --task classify")


def test_integer_labels_and_a_model_of_other_outputs_name_the_task_option(sandbox, capsys):
    line = refused(train("tiny.npz", "--model", "user.py:two_outputs", "--task", "regress"), capsys)
    assert line.endswith("give --task classify")
    (sandbox / "three.py").write_text("import torch\n\ndef make(input_shape, num_outputs):\n"
                                      "    return torch.nn.Linear(4, 3)\n")
    assert refused(train("tiny.npz", "--model", "three.py:make"), capsys) == (
        "model output shape (2, 3) does not match the data: expected (2, 2) for 2 outputs; the data was read as "
        "classification with 2 classes (integer labels 0..1); if its labels are numbers to predict, give --task regress")


def test_a_built_in_data_set_and_a_model_of_other_outputs_name_no_task_option(sandbox, capsys):
    line = refused(["train", "--dataset", "digits", "--model", "user.py:two_outputs", "--workers", "1"], capsys)
    assert line == "model output shape (2, 2) does not match the data: expected (2, 10) for 10 outputs"


# ------------------------------------------------------------------ 5. the cheap checks first


def _bad_model_path(root: Path) -> tuple[list[str], str]:
    return (["--model", "./nets.py:make"],
            f"--model ./nets.py:make: the file './nets.py' does not exist; give the path of a Python file "
            f"(relative to {root}) or package.module:function")


def _unknown_model(root: Path) -> tuple[list[str], str]:
    return ["--model", "resnett"], ("unknown model 'resnett'; did you mean 'resnet'? valid names are mlp, cnn, cnn1d, "
                                    "resnet, nfnet, mlp-regression, or a user model as package.module:factory")


def _bad_loss_path(root: Path) -> tuple[list[str], str]:
    return (["--loss", "losses.py:mine"],
            f"--loss losses.py:mine: the file 'losses.py' does not exist; give the path of a Python file "
            f"(relative to {root}) or package.module:function")


def _finished_out(root: Path) -> tuple[list[str], str]:
    (root / "out").mkdir()
    (root / "out" / ".dptrain-run").write_text("a dptrain run directory\n")
    (root / "out" / "summary.json").write_text("{}")
    return [], "run directory 'out' holds a finished run (summary.json); give --out a new directory"


def _out_of_other_settings(root: Path) -> tuple[list[str], str]:
    from dptrain.config import build_config, to_yaml

    (root / "out").mkdir()
    (root / "out" / ".dptrain-run").write_text("a dptrain run directory\n")
    (root / "out" / "config.yaml").write_text(to_yaml(build_config({"data": "tiny.npz", "out": "out"})))
    (root / "out" / "metrics.jsonl").write_text('{"epoch": 1}\n')
    return [], (f"run directory 'out' holds a run with other settings (data: '{root / 'tiny.npz'}' there, "
                f"'{root / 'user.py'}:counted' now); give --out a new directory, or the same settings to continue it")


@pytest.mark.parametrize("make", [_bad_model_path, _unknown_model, _bad_loss_path, _finished_out,
                                  _out_of_other_settings])
def test_cheap_checks_come_before_the_data_factory_runs(sandbox, capsys, make):
    extra, expected = make(sandbox)
    assert refused(train("user.py:counted", *extra), capsys) == expected
    assert not (sandbox / "factory-called").exists()


def test_a_busy_out_is_refused_before_the_data_factory_runs(sandbox, capsys):
    (sandbox / "out").mkdir()
    with open(sandbox / "out" / "dptrain.lock", "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(b"4242 elsewhere\n")
        held.flush()
        assert refused(train("user.py:counted"), capsys) == (
            "run directory 'out' is in use by another dptrain run (PID 4242 on host elsewhere); wait for it to end "
            "or give --out another directory")
    assert not (sandbox / "factory-called").exists()
    assert sorted(path.name for path in (sandbox / "out").iterdir()) == ["dptrain.lock"]


# ------------------------------------------------------------------ 8. dptrain plot on a run without epochs


def test_plot_of_a_run_that_recorded_no_epoch_says_so(tmp_path, capsys):
    from dptrain import plot
    from dptrain.train.rundir import MARKER

    assert plot.RUN_MARKER == MARKER
    run = tmp_path / "run"
    run.mkdir()
    (run / MARKER).write_text("a dptrain run directory\n")
    (run / "config.yaml").write_text("strategy: allreduce\n")
    assert refused(["plot", str(run)], capsys) == (
        f"run '{run}' recorded no epoch (it has a config.yaml but no metrics.jsonl): it stopped before its first "
        "epoch ended, or has not ended one yet; its output says why; fix that and run it again (the same --out "
        "takes it), then plot it")
    assert sorted(path.name for path in run.iterdir()) == [MARKER, "config.yaml"]
    (tmp_path / "other").mkdir()
    assert refused(["plot", str(tmp_path / "other")], capsys) == (
        f"'{tmp_path / 'other'}' is not a dptrain run directory: no metrics.jsonl")
