"""Class labels, checked alike wherever they come from (an array file, a data factory, the data given to fit):
0..C-1, a negative one refused and a class that no label names said, each in one line."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from dptrain.errors import UserError


def negative_label(what: str, label: float) -> UserError:
    """The one line for a negative class label in `what` (an array of a file, a factory's Dataset, fit's data)."""
    return UserError(f"{what} has negative class label {int(label)}; labels must be 0..C-1.")


def unseen_label(what: str, label: float, training: str, train_max: int) -> UserError:
    """The one line for a test label above every training label (the model has no output for it)."""
    return UserError(f"{what} has class label {int(label)} but {training} only goes up to {train_max}; "
                     "test labels must be classes seen in training.")


def check_class_labels(labels: np.ndarray, what: str, log: Callable[[str], None],
                       test: Optional[np.ndarray] = None, test_what: str = "") -> int:
    """The number of classes of integer `labels` (0..C-1, C = the largest + 1), as an array file's are checked: a
    negative label refused in one line, and a test label (`test`) above every training label; classes that no
    training label names (labels from 1, or gaps) said in one `log` line, since the model's outputs for them are
    trained towards nothing."""
    for where, values in ((what, labels), (test_what, test)):
        if values is not None and values.size and values.min() < 0:
            raise negative_label(where, values.min())
    classes = int(labels.max()) + 1 if labels.size else 0
    if test is not None and test.size and test.max() >= classes:
        raise unseen_label(test_what, test.max(), what, classes - 1)
    say_missing_classes(np.unique(labels), classes, what, log)
    return classes


def say_missing_classes(present: np.ndarray, classes: int, what: str, log: Callable[[str], None]) -> None:
    """One `log` line when some of the classes 0..`classes`-1 are not among the labels `present` in `what`."""
    missing = np.setdiff1d(np.arange(classes), present.astype(np.int64, copy=False))
    if missing.size:
        shown = ", ".join(str(int(c)) for c in missing[:5]) + (f" and {missing.size - 5} more" if missing.size > 5 else "")
        first = " (labels from 1 leave class 0 empty)" if missing[0] == 0 else ""
        log(f"dptrain: warning: {what} has no sample of class {shown} (classes 0..{classes - 1}: the largest label "
            f"+ 1){first}; the model's output for it trains towards nothing: number the classes 0..C-1 with no gaps")
