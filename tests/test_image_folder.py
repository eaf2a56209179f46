"""`--data DIR` with a folder of images in ImageFolder layout (one subfolder per class), read with Pillow."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from dptrain.data.images import ImageFolder, is_image_folder, load_image_folder
from cli_runner import run_dptrain

COLOURS = {"blue": (0, 0, 1), "green": (0, 1, 0), "red": (1, 0, 0)}
ARGS = ["train", "--model", "mlp", "--epochs", "3", "--workers", "2", "--no-progress", "--checkpoint-every", "0",
        "--batch-size", "8"]


def make_folder(root, per_class: int = 40, size: int = 16, split: bool = False, seed: int = 0):
    """Noisy images whose dominant colour is their class; with `split`, train/ and test/ subfolders."""
    rng = np.random.default_rng(seed)
    for part, count in ((("train", per_class), ("test", per_class // 4)) if split else (("", per_class),)):
        for name, colour in COLOURS.items():
            directory = root / part / name
            directory.mkdir(parents=True)
            for i in range(count):
                pixels = 0.5 * rng.random((size, size, 3)) + 0.5 * np.array(colour)
                Image.fromarray((pixels * 255).astype(np.uint8)).save(directory / f"{i:03d}.png")
    return root


def _dptrain(tmp_path, *args):
    return run_dptrain(args, cwd=tmp_path, env=os.environ.copy())


def test_an_image_folder_trains_with_a_held_out_split_said(tmp_path):
    make_folder(tmp_path / "pics")
    done = _dptrain(tmp_path, *ARGS, "--data", "pics", "--out", "run")
    assert done.returncode == 0, done.stderr
    assert "[rank0]" not in done.stdout.split("image folder")[0]  # said once, by the launching process
    assert "dptrain: image folder 'pics': 120 images of 3 classes (blue, green, red), read as 16x16 RGB" in done.stdout
    assert "dptrain: 'pics' has no train/ and test/ subfolders: holding out 24 of its 120 images (20%, chosen by " \
           "the seed) for testing" in done.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.9
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(worker["samples"] for worker in records[0]["workers"]) == 96  # every training image, once


def test_train_and_test_subfolders_resized_and_augmented_under_fedavg(tmp_path):
    make_folder(tmp_path / "pics", split=True)
    done = _dptrain(tmp_path, *ARGS, "--data", "pics", "--image-size", "12", "--augment", "--strategy", "fedavg",
                    "--partition", "dirichlet", "--out", "run")
    assert done.returncode == 0, done.stderr
    assert "read as 12x12 RGB; training images flipped and cropped at random" in done.stdout
    assert "holding out" not in done.stdout and "reading the labels" not in done.stdout  # labels from `targets`
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] is not None and sum(summary["partition_sizes"]) == 120


def test_a_file_that_is_not_an_image_is_named_in_one_line(tmp_path):
    make_folder(tmp_path / "pics", per_class=10)
    (tmp_path / "pics" / "red" / "broken.png").write_bytes(b"not a png at all")
    done = _dptrain(tmp_path, *ARGS, "--data", "pics", "--out", "run")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    # Found while training (files are read as batches need them): the rank that read it says which file.
    said = [line for line in done.stderr.splitlines() if "cannot be read as an image" in line]
    assert len(said) == 1 and said[0].startswith("[rank") and "] dptrain: error: item " in said[0]
    broken = tmp_path / "pics" / "red" / "broken.png"  # config.yaml names --data by its absolute path
    assert said[0].endswith(f"of the training Dataset raised ValueError: '{broken}' cannot be read as an image "
                            f"(cannot identify image file '{broken}')")


@pytest.mark.parametrize("layout, message", [
    ({"only": 3}, "pics' has 1 class subfolder(s) (only); classification needs at least 2"),
    ({}, "pics' has 0 class subfolder(s) (none)"),
])
def test_too_few_classes_is_one_line(tmp_path, layout, message):
    from dptrain.errors import UserError
    (tmp_path / "pics").mkdir()
    for name, count in layout.items():
        (tmp_path / "pics" / name).mkdir()
        for i in range(count):
            Image.new("RGB", (4, 4)).save(tmp_path / "pics" / name / f"{i}.png")
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_image_folder(str(tmp_path / "pics"), seed=0, image_size=None, augment=False, log=print)


def test_items_labels_and_augmentation(tmp_path):
    make_folder(tmp_path / "pics", per_class=4, size=8)
    assert is_image_folder(str(tmp_path / "pics")) and not is_image_folder(str(tmp_path / "pics" / "red"))
    said = []
    data = load_image_folder(str(tmp_path / "pics"), seed=0, image_size=None, augment=True, log=said.append)
    assert data.num_classes == 3 and data.input_shape == (3, 8, 8)
    test = data.test.dataset
    assert isinstance(test, ImageFolder) and not test.augment  # held-out images are never augmented
    x, y = test[0]
    assert x.dtype == torch.float32 and x.shape == (3, 8, 8) and 0 <= x.min() and x.max() <= 1
    channel = COLOURS[sorted(COLOURS)[y]].index(1)  # classes in sorted order: blue, green, red
    assert y == test.targets[0] and all(x[channel].mean() > x[c].mean() for c in range(3) if c != channel)
    train = data.train.dataset
    torch.manual_seed(0)
    shifted = [train[0][0] for _ in range(8)]
    assert any(not torch.equal(shifted[0], other) for other in shifted[1:])  # flips and crops vary
    assert all(image.shape == (3, 8, 8) for image in shifted)
