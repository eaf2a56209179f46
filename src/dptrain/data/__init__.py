"""Datasets for data-parallel training: the blocked DSTensor and the built-in and file sources."""

from dptrain.data.dstensor import DSTensor
from dptrain.data.sources import DATASET_NAMES, Dataset, load_dataset

__all__ = ["DATASET_NAMES", "DSTensor", "Dataset", "load_dataset"]
