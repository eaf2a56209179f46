"""A ShardedStream (dptrain.data.streams) loaded as DataSplits: its task, classes and sample shape, and its test set.

A stream holds no test set of its own: dptrain cannot hold samples out of shards without reading them
all, so a shard pattern trains without one (said in one line) and a factory may return (train, test),
its test set map-style or iterable (an iterable test set is read into memory once: test sets are small).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from dptrain.data.labels import check_class_labels
from dptrain.data.splits import DataSplits
from dptrain.data.streams import ShardedStream
from dptrain.errors import UserError


class ReadItems(Dataset):
    """An iterable test set's (x, y) items, read once into memory."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


def stream_splits(stream: ShardedStream, test: Any, spec: str, log: Callable[[str], None],
                  task: str = "auto") -> DataSplits:
    """The DataSplits of `stream` and its `test` set (None, a map-style Dataset or another stream)."""
    from dptrain.data.sampler import CheckedItems
    from dptrain.data.shard_files import describe
    from dptrain.data.sources import decide_task

    if not len(stream):
        raise UserError(f"--data {spec}: the shards hold no samples; give shards with at least one (x, y) sample")
    log(describe(stream))
    x, y = (torch.as_tensor(np.asarray(part)) for part in stream.first())
    task = decide_task(task, not (y.is_floating_point() or y.is_complex()), str(y.dtype).removeprefix("torch."),
                       (len(stream), *y.shape), f"y of {spec}", log)
    if isinstance(test, ShardedStream):
        test = ReadItems([item for shard in test.shards for item in test.read(shard)])
    if test is None:
        log(f"dptrain: --data {spec}: no test set (shards are not held out); a factory returning (train, test) "
            "gives one")
    else:
        test = CheckedItems(test, "test")
    if task == "regression":
        return DataSplits(stream, test, task, None, tuple(x.shape), max(1, y.numel()), spec)
    labels = stream.labels if stream.labels is not None else _read_labels(stream)
    classes = check_class_labels(np.asarray(labels).astype(np.int64), f"--data {spec}", log)
    return DataSplits(stream, test, task, classes, tuple(x.shape), classes, spec)


def _read_labels(stream: ShardedStream) -> np.ndarray:
    """Every sample's label, by one pass over the shards (their index did not hold them)."""
    return np.asarray([np.asarray(y) for shard in stream.shards for _, y in stream.read(shard)])


def as_stream(data: Any, spec: str = "the training data") -> Optional[ShardedStream]:
    """`data` as a ShardedStream when it is iterable data (a stream already, a WebDataset pipeline, a Hugging Face
    IterableDataset, a torch IterableDataset), else None."""
    if isinstance(data, ShardedStream):
        return data
    from dptrain.data.shard_files import stream_of
    return stream_of(data, spec)
