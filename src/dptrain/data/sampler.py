"""Which rows a rank reads in each epoch, in which order, and the batches they make.

An EpochPlan is the whole answer for one rank: the number of steps per epoch (the same on
every rank, or a per-step collective would hang), the rows of each epoch in visiting order,
and, when a rank keeps the same rows for the whole run (local shuffle, fixed partitions), those
rows, so they are read once. Every strategy takes its plan from `Strategy.epoch_plan`: the
shared sharding by default (dptrain.data.sharding), fixed partitions for fedavg.

BatchReader turns a plan and the (x, y) DSTensors into tensors, one batch per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import numpy as np
import torch

from dptrain.data.dstensor import DSTensor
from dptrain.data import sharding

ArrayLike = Union[DSTensor, np.ndarray, torch.Tensor]


@dataclass
class EpochPlan:
    """One rank's reading plan: `steps` per epoch, `rows(epoch)` in order, `fixed_rows` read once or None."""

    steps: int
    rows: Callable[[int], np.ndarray]
    fixed_rows: Optional[np.ndarray] = None


def shard_plan(n_samples: int, rank: int, world: int, batch_size: int, seed: int, shuffle: str) -> EpochPlan:
    """The shared per-epoch sharding: every rank a slice of one permutation (or its fixed shard)."""
    def rows(epoch: int) -> np.ndarray:
        return sharding.epoch_indices(n_samples, rank, world, epoch, seed, shuffle)

    fixed = None if shuffle == "global" else np.sort(rows(0))
    return EpochPlan(sharding.steps_per_epoch(n_samples, world, batch_size), rows, fixed)


def partition_plan(partition: np.ndarray, rank: int, batch_size: int, seed: int) -> EpochPlan:
    """A partition kept for the whole run, permuted each epoch; its own number of steps."""
    fixed = np.sort(np.asarray(partition))

    def rows(epoch: int) -> np.ndarray:
        return fixed[np.random.default_rng(sharding.derive_seed(seed, epoch, rank)).permutation(len(fixed))]

    return EpochPlan(max(1, -(-len(fixed) // batch_size)), rows, fixed)


def as_dstensor(data: ArrayLike) -> DSTensor:
    return data if isinstance(data, DSTensor) else DSTensor.from_array(data)


def to_tensor(array: np.ndarray) -> torch.Tensor:
    """Features and regression targets as float32, class labels as int64, whatever the file held."""
    if array.dtype.kind == "f" and array.dtype != np.float32:
        array = array.astype(np.float32)
    elif array.dtype.kind in "iu" and array.dtype != np.int64:
        array = array.astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(array))


class BatchReader:
    """The batches of one rank's plan as (x, y) tensors; fixed rows are read from the source once."""

    def __init__(self, x: DSTensor, y: DSTensor, plan: EpochPlan) -> None:
        self.x, self.y, self.plan = x, y, plan
        if plan.fixed_rows is not None:
            self._xs, self._ys = to_tensor(x.take(plan.fixed_rows)), to_tensor(y.take(plan.fixed_rows))

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.plan.rows(epoch)
        if self.plan.fixed_rows is None:
            xs, ys = to_tensor(self.x.take(order)), to_tensor(self.y.take(order))
            positions = np.arange(len(order))
        else:
            xs, ys = self._xs, self._ys
            positions = np.searchsorted(self.plan.fixed_rows, order)
        for batch in sharding.batches(positions, self.plan.steps):
            batch = torch.from_numpy(batch)
            yield xs[batch], ys[batch]
