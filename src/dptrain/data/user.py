"""A user's own data: `--data package.module:factory`, a function returning torch Datasets.

It may also return iterable data (a torch IterableDataset, a WebDataset pipeline, a Hugging Face
`datasets.IterableDataset`: read as a stream, dptrain.data.streams) or a Hugging Face `datasets.Dataset`
(map-style, two of its columns as x and y: dptrain.data.shard_files).

The factory returns `(train, test)`, or `train` alone (or `(train, None)`): then 20 % of it,
chosen by the seed, is held out for testing (dptrain.data.holdout), and that is said. Items are
`(x, y)` pairs; integer labels make a classification task (classes = the largest label + 1), float
targets a regression. Every rank calls the factory itself, so it should be cheap (open files lazily).
"""

from __future__ import annotations

import inspect
import random
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from dptrain.data.holdout import HOLD_OUT, hold_out, holding_out_line
from dptrain.data.splits import DataSplits
from dptrain.data.sampler import CheckedItems, known_labels, labels_of
from dptrain.data.labels import check_class_labels
from dptrain.data.sources import decide_task, first_fraction
from dptrain.data.private import arguments, private_splits, rank_and_world, takes_rank
from dptrain.data.stream_splits import as_stream, stream_splits
from dptrain.errors import UserError
from dptrain.user_code import load_callable


def _item(dataset: Dataset, spec: str, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Item 0 as tensors, or one line saying what is wrong with it (reading it is checked by CheckedItems)."""
    item = dataset[0]
    try:
        return torch.as_tensor(np.asarray(item[0])), torch.as_tensor(np.asarray(item[1]))
    except (TypeError, ValueError, RuntimeError) as error:
        raise UserError(f"--data {spec}: item 0 of the {which} Dataset holds a {type(item[0]).__name__} and a "
                        f"{type(item[1]).__name__}, which are not arrays or numbers: {error}") from None


def as_pairs(value: Any, spec: str) -> Any:
    """A map-style Hugging Face `datasets.Dataset` as a Dataset of (x, y) items (anything else as it is)."""
    from dptrain.data.shard_files import HuggingFacePairs, is_hugging_face
    return HuggingFacePairs(value, spec) if is_hugging_face(value) and not hasattr(value, "n_shards") else value


def _is_dataset(value: Any) -> bool:
    return hasattr(value, "__getitem__") and hasattr(value, "__len__") and not isinstance(value, (tuple, list))


def load_user_data(spec: str, seed: int, test_fraction: float = HOLD_OUT,
                   log: Callable[[str], None] = print, task: str = "auto", check_values: bool = False,
                   workers: int = 1) -> DataSplits:
    """Call the factory `spec` names and describe what it returned; `check_values`: also read every item once,
    refusing NaN and infinite values (the validating process does, as for an array file). A factory taking `rank`
    (or `client`) returns this rank's own data (dptrain.data.private; `workers`: the world the launching
    process starts)."""
    factory = load_callable(spec, "--data", "data", "returns (train, test) Datasets")
    rank_name = takes_rank(factory)
    if rank_name is not None:
        rank, world, in_rank = rank_and_world(workers)
        if not in_rank:
            log(f"dptrain: --data {spec} takes {rank_name}: each of the {world} clients loads its own data on its "
                "own rank; checked here: client 0's only (this machine need not hold the others')")
        given = arguments(factory, rank_name, rank, world, seed)
        return private_splits(_load_returned(factory, given, spec, seed, test_fraction, log, task, True))
    given = {"seed": seed} if "seed" in inspect.signature(factory).parameters else {}
    return _load_returned(factory, given, spec, seed, test_fraction, log, task, check_values)


def _load_returned(factory: Callable, given: dict, spec: str, seed: int, test_fraction: float,
                   log: Callable[[str], None], task: str, check_values: bool) -> DataSplits:
    """The DataSplits of what `factory(**given)` returns."""
    try:
        returned = factory(**given)
    except Exception as error:
        raise UserError(f"data factory {spec} raised {type(error).__name__}: {error}") from error
    train, test = (returned if isinstance(returned, (tuple, list)) and len(returned) == 2 else (returned, None))
    train, test = (as_pairs(value, spec) for value in (train, test))
    stream = as_stream(train, spec)
    if stream is not None:
        return stream_splits(stream, as_stream(test, spec) or test, spec, log, task)
    for which, value in (("train", train), ("test", test)):
        if (value is not None or which == "train") and not _is_dataset(value):
            got = "None" if value is None else f"a value of type {type(value).__name__}"
            raise UserError(f"data factory {spec} returned {got} as its {which} set; "
                            "return (train, test) map-style Datasets (test may be None)")
    if len(train) < 2:
        raise UserError(f"data factory {spec} returned a training set of {len(train)} samples; it needs at least 2")
    return describe_splits(train, test, spec, f"{spec} gave no test set", seed, log, task, test_fraction,
                           check_values)


def describe_splits(train: Dataset, test: Optional[Dataset], spec: str, no_test: str, seed: int,
                    log: Callable[[str], None], task: str, test_fraction: float = HOLD_OUT,
                    check_values: bool = False) -> DataSplits:
    """Checked train and test Datasets (test held out of train when there is none, said as `no_test`:
    holding out ...) with their task, classes and shapes: what a source of torch Datasets loads into.
    `check_values`: read every item once first and refuse NaN and infinite values (check_finite)."""
    train = CheckedItems(train, "training")
    test = CheckedItems(test, "test") if test is not None else None
    read = test_read = None  # every training (test) item's label, when check_finite read them
    if check_values:
        read = check_finite(train, spec)
        if test is not None:
            test_read = check_finite(test, spec)
    test_labels = None if test is None else known_labels(test) if test_read is None else np.asarray(test_read)
    if test is None:
        keep, hold = (part.tolist() for part in hold_out(len(train), seed, test_fraction, at_least_one=True))
        log(holding_out_line(no_test, len(hold), len(train), test_fraction))
        train, test = Subset(train, keep), Subset(train, hold)
        read = None if read is None else [read[i] for i in keep]  # the labels of the Subset's items
    x, y = _item(train, spec, "training")
    task = decide_task(task, not (y.is_floating_point() or y.is_complex()), str(y.dtype).removeprefix("torch."),
                       (len(train), *y.shape), f"y of {spec}", log)
    if task == "regression":
        classes, outputs = None, max(1, y.numel())
    else:
        labels = labels_of(train, log, None if read is None else lambda: np.asarray(read))
        fraction = first_fraction(labels)
        if fraction is not None:
            raise UserError(f"--task classify: {spec} has the label {fraction!r}, which is not a whole "
                            "number; class labels must be 0..C-1")
        classes = outputs = check_class_labels(np.asarray(labels), f"--data {spec}: the training Dataset", log,
                                               test_labels, f"--data {spec}: the test Dataset")
    return DataSplits(train, test, task, classes, tuple(x.shape), outputs, spec)


def _finite(value: Any) -> bool:
    """Whether an item's x or y holds no NaN or infinity (anything that is not an array of numbers passes:
    reading it as one is checked elsewhere)."""
    if isinstance(value, torch.Tensor):
        return not (value.is_floating_point() or value.is_complex()) or bool(torch.isfinite(value).all())
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001 - the user's object: not this check's to judge
        return True
    return array.dtype.kind not in "fc" or bool(np.isfinite(array).all())


def check_finite(dataset: CheckedItems, spec: str) -> Optional[list]:
    """Read every item of a user's Dataset once, refusing NaN and infinite values in x or y before any worker
    starts (as an array file's values are checked): one line naming the split, the first such item and the fix.
    Returns every item's y when each is one number (the labels, so that a classification reads them only
    once), else None (targets of many values are not kept: they could be as large as the data).

    The random state is kept as it was: a Dataset that draws random numbers as it is read (augmentation)
    draws the same in training whether or not it was checked."""
    bad, part, labels = [], "", []  # labels: None once a y of many values is met
    state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            for index in range(len(dataset)):
                x, y = dataset[index]
                if not (_finite(x) and _finite(y)):
                    part = part or ("x (the input)" if not _finite(x) else "y (the label)")
                    bad.append(index)
                if labels is not None and (y.numel() if isinstance(y, torch.Tensor) else np.size(y)) != 1:
                    labels = None
                if labels is not None:
                    labels.append(y.numpy(force=True) if isinstance(y, torch.Tensor) else np.asarray(y))
        finally:
            np.random.set_state(state[0])
            random.setstate(state[1])
    if bad:
        more = f" ({len(bad)} of its {len(dataset)} items do)" if len(bad) > 1 else ""
        raise UserError(f"--data {spec}: item {bad[0]} of the {dataset.role} Dataset holds NaN or infinite values "
                        f"in its {part}{more}; remove or replace them in the data (or in the factory) and run again")
    return labels
