"""What every kind of data source loads into (dptrain.data.kinds): one result type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class DataSplits:
    """A loaded source: train and test Datasets with what a model needs to know about them."""

    train: Any  # a map-style torch Dataset of (x, y) items
    test: Any  # the same for testing: a source without one holds it out (dptrain.data.holdout)
    task: str  # "classification" | "regression"
    num_classes: Optional[int]  # None for regression
    input_shape: tuple[int, ...]  # per-sample shape of x
    num_outputs: int  # model outputs: one per class, or the target's width
    name: str  # what the data is called: a built-in name, a file's stem, the factory spec or folder

    def train_set(self) -> Any:
        return self.train

    def test_set(self) -> Any:
        return self.test
