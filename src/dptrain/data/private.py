"""Each client's own data: a data factory that takes `rank` (or `client`) and `world` returns that rank's private
Dataset, which no other rank reads and which need not exist anywhere else.

    def my_data(rank, world):              # --data clients.py:my_data --strategy fedavg
        return load_my_files(f"/data/client{rank}")   # this client's (train, test), or train alone

Every rank calls the factory with its own rank. The launching process (dptrain train --workers N) sees only
what is on its machine: it calls the factory for client 0 alone, to check that data and build the model, and
says so; every rank checks its own values as it loads them. The ranks then agree on what the model needs (the
task and sample shape must be the same on every client; the classes are the most any client has), and the
strategy trains each client on its whole own set (fedavg: weighted by the sizes the clients report). A test
set is each client's own too: the global model is evaluated on the union of the clients' test sets.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import replace
from typing import Any, Callable, Optional

from dptrain.data.sampler import CheckedItems
from dptrain.data.splits import DataSplits
from dptrain.errors import UserError

RANK_NAMES = ("rank", "client")
_THIS_RANK: Optional[tuple[int, int]] = None  # (rank, world) of this process, once it is a rank of a run


def set_rank(rank: int, world: int) -> None:
    """Make this process rank `rank` of `world` for the factories it calls (dptrain train's ranks do, under any
    launcher, before they load their data)."""
    global _THIS_RANK
    _THIS_RANK = (rank, world)


def takes_rank(factory: Callable) -> Optional[str]:
    """The name under which `factory` takes the rank ('rank' or 'client'), or None: a factory of shared data."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in RANK_NAMES if name in parameters), None)


def rank_and_world(settings_world: int) -> tuple[int, int, bool]:
    """(rank, world, whether this process is a rank of a run): as set_rank made it, else from RANK and WORLD_SIZE
    (the Python API under a launcher), else the launching process's view (client 0 of --workers)."""
    if _THIS_RANK is not None:
        return (*_THIS_RANK, True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), True
    return 0, settings_world, False


def arguments(factory: Callable, name: str, rank: int, world: int, seed: int) -> dict:
    parameters = inspect.signature(factory).parameters
    given = {name: rank, "world": world, "seed": seed}
    return {key: value for key, value in given.items() if key in parameters}


class PrivateItems(CheckedItems):
    """A rank's own Dataset (`private`: the sampler and the evaluation read all of it on this rank alone)."""

    private = True


def private_splits(splits: DataSplits) -> DataSplits:
    """`splits` of one client's own data, marked as such."""
    if getattr(splits.train, "is_stream", False):
        raise UserError(f"--data {splits.name}: a factory of each client's own data returns map-style Datasets; "
                        "iterable data (shards, an IterableDataset) is shared by the ranks, not private, for now")
    test = None if splits.test is None else PrivateItems(splits.test, "test")
    return replace(splits, train=PrivateItems(splits.train, "training"), test=test)


def refuse_partitions(config: Any, name: str) -> None:
    """--partition or --alpha given with each client's own data: they split one shared dataset into the clients'
    parts, which private data is already (one line, rather than ignoring them)."""
    given = getattr(config, "model_fields_set", set())
    for flag in ("partition", "alpha"):
        if flag in given:
            value = getattr(config, flag)
            raise UserError(f"--{flag} {value} splits one dataset every rank reads into the clients' parts, and "
                            f"--data {name} gives each client its own data (its factory takes rank): drop --{flag}")


def agree(group, data: DataSplits) -> DataSplits:
    """The ranks' private data as one model sees it: the same task and sample shape on every rank (else one line
    naming the rank that differs), the most classes any client has."""
    mine = {"task": data.task, "shape": list(data.input_shape), "classes": data.num_classes,
            "outputs": data.num_outputs, "samples": len(data.train)}
    each = group.gather_objects("each client's data", mine)
    for rank, theirs in enumerate(each):
        if (theirs["task"], theirs["shape"]) != (each[0]["task"], each[0]["shape"]):
            raise UserError(f"--data {data.name}: client {rank}'s data is {theirs['task']} of samples shaped "
                            f"{tuple(theirs['shape'])}, client 0's {each[0]['task']} of {tuple(each[0]['shape'])}; "
                            "every client's data must have the same task and sample shape")
    if data.num_classes is None:
        return data
    classes = max(theirs["classes"] for theirs in each)
    return replace(data, num_classes=classes, num_outputs=classes)
