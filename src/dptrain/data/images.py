"""`--data DIR` for a folder of images in ImageFolder layout: one subfolder per class.

    DIR/cat/001.png, DIR/dog/002.jpg, ...                  (20 % held out for testing, said; dptrain.data.holdout)
    DIR/train/cat/001.png, ..., DIR/test/cat/101.png, ...  (the test images given)

Classes are the subfolder names in sorted order (label 0 is the first), as torchvision's
ImageFolder has them; images are decoded with Pillow (no torchvision needed) as RGB floats in
[0, 1], shape (3, H, W), every one resized to the size of the first training image, or to
`--image-size` pixels square when given. `--augment` adds the usual training augmentation:
a random horizontal flip and a random crop of the image padded by 1/8 of its side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from dptrain.data.holdout import hold_out, holding_out_line
# Recognising an image folder needs no torch (the table of kinds and `dptrain launch` ask it).
from dptrain.data.image_files import IMAGE_SUFFIXES as SUFFIXES, class_dirs as _class_dirs, is_image_file
from dptrain.data.image_files import is_image_folder  # noqa: F401 - where tests and users look for it
from dptrain.errors import UserError


def _images(directory: Path) -> list[Path]:
    return sorted(path for path in directory.rglob("*") if is_image_file(path))


class ImageFolder(Dataset):
    """(image tensor, class index) items of image files; `targets` lists every label (for partitioners)."""

    def __init__(self, files: list[Path], targets: list[int], size: tuple[int, int], augment: bool = False) -> None:
        self.files, self.targets, self.size, self.augment = files, targets, size, augment

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = torch.from_numpy(read_image(self.files[index], self.size)).permute(2, 0, 1)
        if self.augment:
            image = _flip_and_crop(image)
        return image, self.targets[index]


def read_image(path: Path, size: Optional[tuple[int, int]] = None) -> np.ndarray:
    """An image file as float32 RGB in [0, 1], (height, width, 3), resized to `size` (width, height)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
            if size is not None and image.size != size:
                image = image.resize(size, Image.Resampling.BILINEAR)
            return np.asarray(image, dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise ValueError(f"'{path}' cannot be read as an image ({str(error).splitlines()[0]})") from None


def _flip_and_crop(image: torch.Tensor) -> torch.Tensor:
    """A random horizontal flip, then a random crop of the image zero-padded by 1/8 of its side."""
    if torch.rand(()) < 0.5:
        image = image.flip(-1)
    height, width = image.shape[-2:]
    pad = max(1, min(height, width) // 8)
    padded = torch.nn.functional.pad(image, (pad, pad, pad, pad))
    top, left = (int(v) for v in torch.randint(0, 2 * pad + 1, (2,)))
    return padded[:, top:top + height, left:left + width]


def _labelled(top: Path, classes: list[str], where: str) -> tuple[list[Path], list[int]]:
    files, targets = [], []
    for label, name in enumerate(classes):
        found = _images(top / name) if (top / name).is_dir() else []
        files += found
        targets += [label] * len(found)
    if not files:
        raise UserError(f"image folder '{where}' holds no images ({', '.join(sorted(SUFFIXES))}) in its class "
                        "subfolders")
    return files, targets


def load_image_folder(path: str, seed: int, image_size: Optional[int], augment: bool,
                      log: Callable[[str], None], task: str = "auto"):
    """The DataSplits of an image folder (see the module docstring)."""
    from dptrain.data.user import describe_splits

    root = Path(path)
    split = (root / "train").is_dir() and (root / "test").is_dir()
    top = root / "train" if split else root
    classes = [directory.name for directory in _class_dirs(top)]
    if len(classes) < 2:
        raise UserError(f"image folder '{path}' has {len(classes)} class subfolder(s) ({', '.join(classes) or 'none'}); "
                        "classification needs at least 2, one subfolder of images per class")
    files, targets = _labelled(top, classes, str(top))
    empty = [name for label, name in enumerate(classes) if label not in set(targets)]
    if empty:  # a class without images would be a class the model never sees (or, last, no class at all)
        raise UserError(f"image folder '{top}' has class subfolder{'s' if len(empty) > 1 else ''} without images "
                        f"({', '.join(empty)}); put each class's images ({', '.join(sorted(SUFFIXES))}) in its "
                        "subfolder, or remove the subfolders of classes you do not use")
    if image_size is not None:
        size = (image_size, image_size)
    else:
        from PIL import Image
        try:
            with Image.open(files[0]) as first:
                size = first.size
        except OSError as error:
            raise UserError(f"'{files[0]}' cannot be read as an image ({error})") from None
    log(f"dptrain: image folder '{path}': {len(files)} images of {len(classes)} classes "
        f"({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''}), read as {size[0]}x{size[1]} RGB"
        f"{'; training images flipped and cropped at random' if augment else ''}")
    if split:
        extra = sorted({d.name for d in _class_dirs(root / "test")} - set(classes))
        if extra:
            raise UserError(f"image folder '{root / 'test'}' has classes that '{top}' lacks: {', '.join(extra)}")
        train = ImageFolder(files, targets, size, augment)
        test = ImageFolder(*_labelled(root / "test", classes, str(root / "test")), size)
    else:  # held out here rather than by describe_splits: test images are never augmented
        keep, hold = (sorted(part.tolist()) for part in hold_out(len(files), seed, at_least_one=True))
        log(holding_out_line(f"'{path}' has no train/ and test/ subfolders", len(hold), len(files), unit="images"))
        train = ImageFolder([files[i] for i in keep], [targets[i] for i in keep], size, augment)
        test = ImageFolder([files[i] for i in hold], [targets[i] for i in hold], size)
    return describe_splits(train, test, path, "", seed, log, task)
