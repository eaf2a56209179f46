"""Recognising a folder of images (one subfolder per class) by its file names alone: no numpy, torch or
Pillow, so that the table of data kinds and `dptrain launch` can ask cheaply."""

from __future__ import annotations

from pathlib import Path

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}


def class_dirs(root: Path) -> list[Path]:
    """The class subfolders of an image folder, in sorted order (label 0 is the first)."""
    return sorted(child for child in root.iterdir() if child.is_dir() and not child.name.startswith("."))


def is_image_file(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()


def is_image_folder(path: str) -> bool:
    """Whether `path` is a directory of class subfolders holding images (not a directory of .npy files)."""
    root = Path(path)
    if not root.is_dir() or root.suffix.lower() == ".zarr" or (root / "x.npy").exists():
        return False
    top = root / "train" if (root / "train").is_dir() else root
    # Stops at the first image: recognising a large folder reads few names.
    return any(is_image_file(file) for directory in class_dirs(top) for file in directory.rglob("*"))
