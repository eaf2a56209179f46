"""Which rows a rank reads in each epoch, in which order, and the batches they make.

An EpochPlan is the whole answer for one rank: the number of steps per epoch (the same on
every rank, or a per-step collective would hang) and the rows of each epoch in visiting order.
Every strategy takes its plan from `Strategy.epoch_plan`: the
shared sharding by default (dptrain.data.sharding), fixed partitions for fedavg.

A DataLoader driven by the plan (`PlanBatches`) streams the batches: no layer reads a
worker's whole shard at once. Arrays and DSTensors enter as `ArrayPairs`, which reads a batch's
rows in one call; a user's own map-style Dataset of (x, y) items enters as it is, with
DataLoader's worker processes, pinned memory and prefetching when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, TensorDataset, default_collate

from dptrain.data.dstensor import DSTensor
from dptrain.errors import UserError, UserTypeError
from dptrain.data import sharding
from dptrain.data.labels import check_class_labels

ArrayLike = Union[DSTensor, np.ndarray, torch.Tensor]


@dataclass
class EpochPlan:
    """One rank's reading plan: `steps` per epoch and `rows(epoch)`, the rows of an epoch in visiting order;
    `rest`: the rest of one epoch after some steps, shared out again over a new world (`Rest`)."""

    steps: int
    rows: Callable[[int], np.ndarray]
    rest: Optional["Rest"] = None
    rank: int = 0  # this rank's place among the members of `rest`
    batches: Optional[Callable[[int], list]] = None  # the rows of each step of an epoch, when not rows cut in steps


@dataclass(frozen=True)
class Rest:
    """The rest of epoch `epoch` after its first `done` steps (allreduce's commits, --commit-every-steps, a resume
    on another world): each member's rows of it, in the members' order (`parts`), read in `steps` steps; `read`,
    the rows of the epoch each rank of the job read before (`members`: ranks of the job, in order).

    With `size` > 1 the members are replica groups of `size` ranks (a sharded model, dptrain.strategies.sharded):
    part g is replica group g's (ranks members[g*size:(g+1)*size]), each of its steps split over the group's
    ranks as `replica_plan` splits them. `lineage`: how the epoch came to be shared so, (members, done, size,
    batch size of a rank) from its start, then at each sharing out again; a checkpoint within the epoch records
    it (dptrain.train.planner), so that a resume makes the same rest again, whatever world it has."""

    epoch: int
    done: int
    parts: tuple[np.ndarray, ...]
    steps: int
    members: tuple[int, ...]
    read: tuple[tuple[int, int], ...] = ()  # (rank of the job, rows read before `done`)
    size: int = 1
    lineage: tuple[tuple[tuple[int, ...], int, int, int], ...] = ()

    @classmethod
    def whole(cls, epoch: int, n_samples: int, members, batch_size: int, seed: int, shuffle: str,
              block_size: Optional[int] = None, size: int = 1) -> "Rest":
        """All of epoch `epoch` as the shared sharding reads it over `members` (`shard_plan`), or over their
        replica groups of `size` ranks (`replica_plan`)."""
        groups = len(members) // size
        parts = tuple(sharding.epoch_indices(n_samples, group, groups, epoch, seed, shuffle, block_size)
                      for group in range(groups))
        return cls(epoch, 0, parts, replica_steps(n_samples, groups, size, batch_size), tuple(members), (), size,
                   ((tuple(members), 0, size, batch_size),))

    def after(self, done: int, members, batch_size: int, size: int = 1) -> "Rest":
        """What is left of the epoch once `done` of its steps are done (`done` at or after this rest's start),
        shared out over `members` (ranks of the job; in replica groups of `size`): every row not read yet, once;
        none read twice."""
        left, read = [], dict(self.read)
        for place, part in enumerate(self.parts):
            taken, unread = self.unread(place, part, done - self.done)
            for rank, rows in self._read_in_group(place, taken):
                read[rank] = read.get(rank, 0) + rows
            left.append(unread)
        rows = np.concatenate(left) if left else np.empty(0, dtype=np.int64)
        groups = len(members) // size
        steps = replica_steps(len(rows), groups, size, batch_size) if len(rows) else 0
        return replace(self, done=done, parts=tuple(np.array_split(rows, groups)), steps=steps,
                       members=tuple(members), read=tuple(sorted(read.items())), size=size,
                       lineage=self.lineage + ((tuple(members), done, size, batch_size),))

    def _read_in_group(self, place: int, taken: list) -> list[tuple[int, int]]:
        """(rank of the job, rows) read of part `place` by each rank of its replica group (one, unsharded), from
        the part's steps read (`taken`, as `unread` gives them)."""
        ranks = self.members[place * self.size:(place + 1) * self.size]
        return [(rank, sum(len(rows) for rows in self.split(taken, j))) for j, rank in enumerate(ranks)]

    def split(self, steps: list, place: int) -> list:
        """The rows of each of `steps` (a replica group's) that the rank at `place` of the group reads."""
        return steps if self.size == 1 else [np.array_split(step, self.size)[place] for step in steps]

    def unread(self, place: int, part: np.ndarray, taken: int) -> tuple[list[np.ndarray], np.ndarray]:
        """(the rows of each of the first `taken` steps of this rest that `part`, the member at `place`'s, was
        read in; the rows of `part` they left unread, in order)."""
        pieces = sharding.batches(part, self.steps)
        left = pieces[taken:]
        return pieces[:taken], (np.concatenate(left) if left else part[:0])

    def read_by(self, ranks) -> int:
        """Rows of the epoch read before this rest by `ranks` (of the job)."""
        return sum(rows for rank, rows in self.read if rank in ranks)


def shard_plan(n_samples: int, rank: int, world: int, batch_size: int, seed: int, shuffle: str,
               block_size: Optional[int] = None) -> EpochPlan:
    """The shared per-epoch sharding: every rank a slice of one permutation (or its fixed shard)."""
    def rows(epoch: int) -> np.ndarray:
        return sharding.epoch_indices(n_samples, rank, world, epoch, seed, shuffle, block_size)

    return EpochPlan(sharding.steps_per_epoch(n_samples, world, batch_size), rows)


def replica_steps(n_samples: int, groups: int, size: int, batch_size: int) -> int:
    """The steps every rank takes over `n_samples` rows shared by `groups` replica groups of `size` ranks, each
    step `size` x `batch_size` rows of a group (at least `size`, so that no rank of a group goes without); with
    `size` 1, `sharding.steps_per_epoch`."""
    sharding.check_workers(n_samples, groups)
    return max(1, min(sharding.steps_per_epoch(n_samples, groups, size * batch_size), n_samples // groups // size))


def replica_plan(n_samples: int, rank: int, world: int, size: int, batch_size: int, seed: int, shuffle: str,
                 block_size: Optional[int] = None) -> EpochPlan:
    """A rank's plan in replica groups of `size` ranks (a sharded model, dptrain.strategies.sharded): replica
    group g reads what worker g of world/size unsharded workers reads with `size` x `batch_size` rows a step,
    and each step's rows are split over the group's ranks, rank j of the group taking the j-th part. So a
    replica group computes what one unsharded worker does with `size` times the batch, and every row is read
    once an epoch. At least `size` rows a step, so that no rank of a group goes without."""
    replicas, group, place = world // size, rank // size, rank % size
    sharding.check_workers(n_samples, world)
    steps = replica_steps(n_samples, replicas, size, batch_size)
    return _split_steps(lambda epoch: sharding.epoch_indices(n_samples, group, replicas, epoch, seed, shuffle,
                                                             block_size), steps, size, place)


def partition_replica_plan(partition: np.ndarray, group: int, size: int, place: int, batch_size: int,
                           seed: int) -> EpochPlan:
    """Rank `place` of replica group `group` (of `size` ranks) reading the group's fixed `partition` (fedavg's
    client `group`, its model sharded): what unsharded client `group` reads with `size` x `batch_size` rows a
    step (`partition_plan`, the same permutation each epoch), each step's rows split over the group's ranks as
    `replica_plan` splits them. At least `size` rows a step, so that no rank of the group goes without."""
    if len(partition) < size:
        raise UserError(f"client {group}'s partition holds {len(partition)} samples, fewer than the {size} ranks of "
                        f"its replica group (--shard-size {size}); give more data, fewer clients or a smaller "
                        f"--shard-size")
    whole = partition_plan(partition, group, size * batch_size, seed)
    return _split_steps(whole.rows, max(1, min(whole.steps, len(partition) // size)), size, place)


def _split_steps(rows: Callable[[int], np.ndarray], steps: int, size: int, place: int) -> EpochPlan:
    """The plan of the rank at `place` of a group of `size` ranks that reads `rows(epoch)` in `steps` steps
    together, each step's rows split over the group, this rank taking the place-th part."""

    def batches(epoch: int) -> list[np.ndarray]:
        return [np.array_split(step, size)[place] for step in sharding.batches(rows(epoch), steps)]

    return EpochPlan(steps, lambda epoch: np.concatenate(batches(epoch)), batches=batches)


def partition_plan(partition: np.ndarray, rank: int, batch_size: int, seed: int) -> EpochPlan:
    """A partition kept for the whole run, permuted each epoch; its own number of steps."""
    fixed = np.sort(np.asarray(partition))

    def rows(epoch: int) -> np.ndarray:
        return fixed[np.random.default_rng(sharding.derive_seed(seed, epoch, rank)).permutation(len(fixed))]

    return EpochPlan(max(1, -(-len(fixed) // batch_size)), rows)


def as_dstensor(data: ArrayLike) -> DSTensor:
    return data if isinstance(data, DSTensor) else DSTensor.from_array(data)


def _cast(tensor: torch.Tensor) -> torch.Tensor:
    """Features and regression targets as float32, class labels as int64, whatever the data held."""
    if tensor.is_floating_point() and tensor.dtype != torch.float32:
        return tensor.float()
    if not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype not in (torch.int64, torch.bool):
        return tensor.long()
    return tensor


def to_tensor(array: np.ndarray) -> torch.Tensor:
    """Rows read from arrays or files, as the loop wants them (see _cast)."""
    return _cast(torch.from_numpy(np.ascontiguousarray(array)))


class ArrayPairs(Dataset):
    """(x, y) DSTensors as a map-style Dataset that reads a whole batch of rows at once."""

    def __init__(self, x: DSTensor, y: DSTensor) -> None:
        if len(x) != len(y):
            raise UserError(f"x has {len(x)} samples but y has {len(y)}; they must match")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([row])
        return x[0], y[0]

    def __getitems__(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return to_tensor(self.x.take(rows)), to_tensor(self.y.take(rows))

    @property
    def block_size(self) -> int:
        return self.x.block_size

    def labels(self) -> np.ndarray:
        return self.y.to_numpy()


TrainData = Union[tuple, list, Dataset]


class CheckedItems(Dataset):
    """A user's Dataset whose failures name the item: one that raises, or is not an (x, y) pair."""

    def __init__(self, dataset: Dataset, role: str) -> None:
        self.dataset, self.role = dataset, role

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        try:
            item = self.dataset[index]
        except Exception as error:
            raise UserError(f"item {index} of the {self.role} Dataset raised {type(error).__name__}: "
                            f"{str(error).splitlines()[0] if str(error) else ''}") from error
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            what = (f"a {type(item).__name__} of {len(item)} values" if isinstance(item, (tuple, list))
                    else f"of type {type(item).__name__}")
            raise UserError(f"item {index} of the {self.role} Dataset is {what}; each item must be an (x, y) pair")
        return item


def as_dataset(data: TrainData, role: str = "training") -> Dataset:
    """A (x, y) pair of arrays, tensors or DSTensors, or any map-style Dataset of (x, y) items; a stream as it is
    (iterable data is made one first: dptrain.data.stream_splits.as_stream)."""
    if isinstance(data, (ArrayPairs, CheckedItems)) or getattr(data, "is_stream", False):
        return data
    if isinstance(data, Dataset):
        return CheckedItems(data, role)
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return ArrayPairs(as_dstensor(data[0]), as_dstensor(data[1]))
    what = f"a {type(data).__name__} of {len(data)}" if isinstance(data, (tuple, list)) else type(data).__name__
    raise UserTypeError(f"training and test data must be an (x, y) pair or a torch Dataset, not {what}")


def known_labels(dataset: Dataset) -> "np.ndarray | None":
    """Labels a dataset states without reading its items: arrays, a TensorDataset's, a `targets`/`labels`
    attribute."""
    if isinstance(dataset, ArrayPairs):
        return dataset.labels()
    if isinstance(dataset, CheckedItems):
        return known_labels(dataset.dataset)
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2 and dataset.tensors[1].dim() == 1:
        return dataset.tensors[1].numpy(force=True)
    for name in ("targets", "labels"):
        if hasattr(dataset, name) and not callable(getattr(dataset, name)):
            return np.asarray(getattr(dataset, name))
    if isinstance(dataset, Subset):  # a held-out split: its parent's labels where it states them
        parent = known_labels(dataset.dataset)
        return None if parent is None else parent[np.asarray(dataset.indices)]
    return None


def check_known_labels(train: Dataset, test: Optional[Dataset], log: Callable[[str], None]) -> None:
    """fit's data under a classification loss, as an array file's and a factory's are checked, where the
    labels are known without reading the items (known_labels): integer class labels 0..C-1
    (dptrain.data.sources.check_class_labels)."""
    labels = known_labels(train)
    if labels is None or labels.dtype.kind not in "iu" or labels.ndim != 1:
        return
    tested = known_labels(test) if test is not None else None
    check_class_labels(labels, "the training data passed to fit", log,
                       tested if tested is not None and tested.dtype.kind in "iu" else None,
                       "the test data passed to fit")


def labels_of(dataset: Dataset, log: Callable[[str], None] = print,
              read: Optional[Callable[[], np.ndarray]] = None) -> np.ndarray:
    """Every sample's label (for partitioners): from the data, a `targets`/`labels` attribute, or one pass
    (`read`: the labels of every item, read already, instead of that pass)."""
    known = known_labels(dataset)
    if known is not None:
        return known
    if read is not None:
        return read()
    log(f"dptrain: reading the labels of all {len(dataset)} samples once (the Dataset has no `targets` attribute)")
    return np.asarray([np.asarray(dataset[i][1]) for i in range(len(dataset))])


class PlanBatches(Sampler):
    """The rows of each step of one epoch of a plan, as a DataLoader batch sampler (call set_epoch first).

    `set_epoch(epoch, start)` begins the epoch at its step `start` (a run resumed from a checkpoint within
    the epoch): the batches before it are skipped without reading their rows."""

    def __init__(self, plan: EpochPlan) -> None:
        self.plan, self.epoch, self.start = plan, 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _rest(self) -> Optional[Rest]:
        rest = self.plan.rest
        return rest if rest is not None and rest.epoch == self.epoch else None

    def __len__(self) -> int:
        rest = self._rest()
        return (rest.done + rest.steps if rest is not None else self.plan.steps) - self.start

    def __iter__(self) -> Iterator[list[int]]:
        rest = self._rest()
        if rest is not None:  # the epoch's rest, after its first rest.done steps
            group, place = divmod(self.plan.rank, rest.size)
            steps = rest.split(sharding.batches(rest.parts[group], rest.steps), place) if rest.steps else []
            first = rest.done
        else:
            plan = self.plan
            steps = plan.batches(self.epoch) if plan.batches else sharding.batches(plan.rows(self.epoch), plan.steps)
            first = 0
        for index, batch in enumerate(steps, start=first):
            if index >= self.start:
                yield batch.tolist()


class FixedBatches(Sampler):
    """Fixed batches of rows (evaluation: a rank's contiguous slice, in order)."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)


def collate_items(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """ArrayPairs hands over a ready (x, y); a user Dataset a list of (x, y) items."""
    if isinstance(batch, tuple):
        x, y = batch
    else:
        try:
            x, y = default_collate(batch)
        except (RuntimeError, TypeError) as error:  # items of different shapes or types
            raise UserError(f"the Dataset's items cannot form one batch (each x must have the same shape and "
                            f"each y the same type): {str(error).splitlines()[0]}") from error
    return _cast(x), _cast(y)


def loader(dataset: Dataset, batch_sampler: Sampler, workers: int = 0, pin_memory: bool = False) -> DataLoader:
    """A DataLoader over `dataset` whose batches are exactly the sampler's rows, in its order."""
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_items, num_workers=workers,
                      pin_memory=pin_memory, persistent_workers=workers > 0)


def evaluation_loader(dataset: Dataset, rank: int, world: int, batch_size: int, workers: int = 0,
                      pin_memory: bool = False) -> DataLoader:
    """This rank's contiguous slice of `dataset` (all of it when world is 1), in order, `batch_size` rows a batch."""
    n = len(dataset)
    if getattr(dataset, "private", False):  # this rank's own test set (dptrain.data.private): all of it
        rank, world = 0, 1
    start, stop = rank * n // world, (rank + 1) * n // world
    batches = [list(range(first, min(first + batch_size, stop))) for first in range(start, stop, batch_size)]
    return loader(dataset, FixedBatches(batches), workers, pin_memory)
