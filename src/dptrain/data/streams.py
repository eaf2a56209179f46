"""Sharded and streaming training data: WebDataset tar shards, Parquet files, iterable Datasets, read once an epoch.

A `ShardedStream` is a list of shards whose sample counts are known before training (a tar's index, a
Parquet file's metadata, one counting pass over a plain IterableDataset), and a function that reads one
shard's (x, y) samples in order. The counts let every rank compute the same plan up front, so that no
collective waits on a rank that ran out and every sample is read exactly once an epoch.

The rule, for epoch e over W ranks with L loader workers each and batch B (pure functions below):

1. The shards are put in an order: a permutation drawn from (seed, e) (file order with --shuffle none; every
   other --shuffle draws it).
2. In that order they make one sequence of N samples. Rank r reads positions [r*N//W, (r+1)*N//W) of it:
   shard sizes may differ, so a shard may be cut between two ranks (each reads its part; the later one
   skips the first samples of that shard). Ranks differ by at most one sample.
3. Every rank takes S = dptrain.data.sharding.steps_per_epoch(N, W, B) steps (the same on every rank,
   so an uneven end never hangs), its samples cut into S near-equal batches as for map-style data.
4. With L loader workers, step k is made by worker k mod L; each worker reads one contiguous part of the
   rank's samples (the batches of its steps, in order), so a shard is read by at most a few workers and
   nobody reads another worker's samples. The DataLoader takes the workers' batches in turn: step order.
5. Within a worker, samples pass through a shuffle buffer of SHUFFLE_BUFFER samples drawn from
   (seed, e, rank, worker) (none with --shuffle none): every sample leaves it exactly once.

So the batches depend on --loader-workers (as every IterableDataset's do), not on anything else. A
run resumed within an epoch (--checkpoint-every-steps) replays the worker's part up to its step and goes
on from there: the same samples in the same batches as an uninterrupted run.

After a membership change (--min-workers: a worker lost, one leaving or joining at an epoch end) the rule
is applied again over the new world W' from the epoch the workers go on with: from its start (the strategies
that redo a lost worker's epoch, and every change at an epoch end) rank r of W' reads positions
[r*N//W', (r+1)*N//W'). From a commit within the epoch (allreduce's --commit-every-steps) the workers go on
with its rest (`StreamRest`): every position no rank had read in the steps before the commit (found by
replaying rules 3 to 5 on positions: the shuffle buffer's draws do not depend on what it holds), laid in
order and cut over W' as in rule 2, read by rules 3 to 5 with shuffle numbers of the rest's own.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from dataclasses import dataclass
from itertools import count, groupby, islice
from operator import itemgetter
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dptrain.data import sharding
from dptrain.data.sampler import Rest
from dptrain.errors import UserError

SHUFFLE_BUFFER = 1024  # samples held by each loader worker's shuffle buffer
DRAWS = 1024  # the shuffle buffer's indices drawn at a time


@dataclass(frozen=True)
class Shard:
    """One shard: what it is called in messages (a path) and how many samples it holds."""

    name: str
    samples: int


# -- the rule (pure functions) ---------------------------------------------------------------------------
def shard_order(shards: int, epoch: int, seed: int, shuffle: str) -> np.ndarray:
    """The shards' order in `epoch`: a permutation drawn from (seed, epoch), or file order for 'none'."""
    if shuffle == "none":
        return np.arange(shards)
    return np.random.default_rng(sharding.derive_seed(seed, epoch, 0x5A4D)).permutation(shards)


def rank_segments(counts: list[int], order: np.ndarray, rank: int, world: int) -> list[tuple[int, int, int]]:
    """Rank `rank`'s part of the epoch: (shard, first, stop) pieces, in reading order, of positions
    [rank*N//world, (rank+1)*N//world) of the shards' samples laid end to end in `order`."""
    total = sum(counts)
    return _cut([(int(shard), 0, counts[shard]) for shard in order], rank * total // world,
                (rank + 1) * total // world)


def _cut(pieces: list[tuple[int, int, int]], start: int, stop: int) -> list[tuple[int, int, int]]:
    """The positions [start, stop) of the samples of `pieces` laid end to end, as pieces."""
    out, position = [], 0
    for shard, first, end in pieces:
        length = end - first
        low, high = max(start, position), min(stop, position + length)
        if low < high:
            out.append((shard, first + low - position, first + high - position))
        position += length
    return out


def position_pieces(counts: list[int], order: np.ndarray, positions: np.ndarray) -> list[tuple[int, int, int]]:
    """The samples at `positions` (ascending) of the shards laid end to end in `order`, as (shard, first, stop)
    pieces: one a run of consecutive positions within a shard."""
    positions = np.asarray(positions, dtype=np.int64)
    if not len(positions):
        return []
    ends = np.cumsum([counts[shard] for shard in order])
    slot = np.searchsorted(ends, positions, side="right")  # the place in `order` of each position's shard
    local = positions - (ends[slot] - np.asarray([counts[shard] for shard in order])[slot])
    breaks = np.flatnonzero((np.diff(positions) != 1) | (np.diff(slot) != 0)) + 1
    return [(int(order[slot[run[0]]]), int(local[run[0]]), int(local[run[-1]]) + 1)
            for run in np.split(np.arange(len(positions)), breaks)]


def copy_order(counts: list[int], epoch: int, seed: int, shuffle: str, ranks: range, world: int) -> list[int]:
    """The shards in the order `ranks` (one node's) first read them in `epoch` and then `epoch + 1`: each rank's
    next shard in turn (--stage-to copies them so: each rank's first shard first)."""
    order: dict[int, None] = {}
    for read in (epoch, epoch + 1):
        shards = shard_order(len(counts), read, seed, shuffle)
        lists = [[shard for shard, _, _ in rank_segments(counts, shards, rank, world)] for rank in ranks]
        for turn in range(max(map(len, lists), default=0)):
            order.update((part[turn], None) for part in lists if turn < len(part))
    return list(order)


def reading_rng(seed: int, epoch: int, rank: int, role: int, shuffle: str,
                rest_from: int = 0) -> Optional[np.random.Generator]:
    """The shuffle buffer's random numbers of loader worker `role` of `rank` in `epoch` (None: --shuffle none); in
    the rest of an epoch shared out again from its step `rest_from` (> 0), numbers of that rest's own."""
    if shuffle == "none":
        return None
    return np.random.default_rng(sharding.derive_seed(seed, epoch, rank, role, *((rest_from,) if rest_from else ())))


def batch_sizes(samples: int, steps: int) -> list[int]:
    """The sizes of a rank's `steps` batches of `samples` (np.array_split's, as for map-style data)."""
    return [len(part) for part in np.array_split(np.arange(samples), steps)]


def worker_part(segments: list[tuple[int, int, int]], sizes: list[int], role: int,
                workers: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Loader worker `role`'s pieces and batch sizes: the steps k with k mod workers == role, whose samples
    form the role's contiguous part of the rank's (the roles' parts follow each other in role order)."""
    workers = max(1, workers)
    mine = [size for step, size in enumerate(sizes) if step % workers == role]
    before = sum(size for step, size in enumerate(sizes) if step % workers < role)
    return _cut(segments, before, before + sum(mine)), mine


def shuffled(samples: Iterable, buffer: int, rng: Optional[np.random.Generator]) -> Iterator:
    """`samples` through a shuffle buffer of `buffer` (as they come without `rng`): each exactly once. Once the
    buffer is full, each sample that comes takes the place of the one at a drawn index, which leaves; the indices
    are drawn 1,024 at a time, a block when the first sample that needs one comes (so the draws, and the order,
    depend only on the number of samples); at the end the samples held leave in a drawn permutation."""
    if rng is None or buffer <= 1:
        yield from samples
        return
    samples = iter(samples)
    held = list(islice(samples, buffer))
    while True:
        coming = list(islice(samples, DRAWS))  # (a block read ahead: the per-sample work is the swap alone)
        if not coming:
            break
        for index, sample in zip(rng.integers(buffer, size=DRAWS).tolist(), coming):
            held[index], sample = sample, held[index]
            yield sample
    for index in rng.permutation(len(held)).tolist():
        yield held[index]


def read_first(positions: np.ndarray, steps: int, done: int, workers: int,
               rng: Callable[[int], Optional[np.random.Generator]]) -> np.ndarray:
    """The positions a rank reading `positions` in `steps` steps (rules 3 to 5: `workers` loader workers, worker
    role r's shuffle buffer drawing from `rng(r)`) had read in its first `done` steps. The buffer's draws do not
    depend on what it holds, so shuffling the positions replays the order the samples came in."""
    workers, sizes, read = max(1, workers), batch_sizes(len(positions), steps), []
    for role in range(workers):
        [(_, first, stop)], mine = worker_part([(0, 0, len(positions))], sizes, role, workers)
        taken = sum(mine[:sum(1 for step in range(done) if step % workers == role)])
        came = shuffled(iter(range(stop - first)), SHUFFLE_BUFFER, rng(role))
        read.append(positions[first:stop][np.fromiter(came, dtype=np.int64, count=stop - first)[:taken]])
    return np.concatenate(read)


@dataclass(frozen=True)
class StreamRest(Rest):
    """The rest of a stream's epoch `epoch` after its first `done` steps (allreduce's commits), shared out over
    `members`: `parts` are positions of the epoch's shards laid end to end (rule 2), each member's ascending;
    read by the rules' batches, loader workers (`workers`) and shuffle buffer (`seed`, `shuffle`)."""

    workers: int = 0
    seed: int = 0
    shuffle: str = "global"

    @classmethod
    def whole_stream(cls, epoch: int, samples: int, members, batch_size: int, workers: int, seed: int,
                     shuffle: str) -> "StreamRest":
        """All of epoch `epoch` as `members` read it by the rule: member r positions [r*N//W, (r+1)*N//W)."""
        world = len(members)
        parts = tuple(np.arange(r * samples // world, (r + 1) * samples // world) for r in range(world))
        return cls(epoch, 0, parts, sharding.steps_per_epoch(samples, world, batch_size), tuple(members),
                   lineage=((tuple(members), 0, 1, batch_size),), workers=workers, seed=seed, shuffle=shuffle)

    def unread(self, place: int, part: np.ndarray, taken: int) -> tuple[list[np.ndarray], np.ndarray]:
        read = read_first(part, self.steps, taken, self.workers,
                          lambda role: reading_rng(self.seed, self.epoch, place, role, self.shuffle, self.done))
        return [read], np.setdiff1d(part, read)  # (one piece: a stream is never read by replica groups)


def collate_pairs(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of (x, y) samples as (x, y) tensors. Samples of numpy arrays of one shape and type, and labels of
    one type, are stacked by numpy and made a tensor once a batch (DataLoader's default_collate makes one a
    sample, then stacks them); the values and types are default_collate's. Anything else goes to it (through
    dptrain.data.sampler.collate_items)."""
    from dptrain.data.sampler import collate_items

    if batch and all(isinstance(sample, tuple) and len(sample) == 2 for sample in batch):
        xs, ys = zip(*batch)
        if _stackable(xs) and (_stackable(ys) or _same_scalars(ys)):
            return _stacked(xs), _stacked(ys)
    return collate_items(batch)


def _stacked(values: tuple) -> torch.Tensor:
    """`values` (arrays of one shape and type, or scalars of one type) as one tensor of the loop's type
    (sampler.to_tensor). In a loader worker it is stacked straight into shared memory, as default_collate does:
    a batch sent to the training process is moved to shared memory, a copy this saves."""
    from dptrain.data.sampler import to_tensor

    if get_worker_info() is None:
        return to_tensor(np.stack(values) if isinstance(values[0], np.ndarray) else np.asarray(values))
    first = np.asarray(values[0])
    dtype = to_tensor(np.empty(0, dtype=first.dtype)).dtype  # the type to_tensor would give the batch
    storage = torch.UntypedStorage._new_shared(len(values) * first.size * dtype.itemsize)
    out = torch.empty(0, dtype=dtype).set_(storage, 0, (len(values), *first.shape))
    np.stack(values, out=out.numpy(), casting="unsafe")  # (to_tensor's casts: float64 to float32, ints to int64)
    return out


def _stackable(values: tuple) -> bool:
    first = values[0]
    return type(first) is np.ndarray and first.dtype.kind in "biufc" and all(
        type(value) is np.ndarray and value.shape == first.shape and value.dtype == first.dtype for value in values)


def _same_scalars(values: tuple) -> bool:
    """Python ints, bools or floats, or numpy scalars, all of one type: np.asarray gives default_collate's dtype."""
    kind = type(values[0])
    return (kind in (int, bool, float) or (issubclass(kind, np.generic) and np.dtype(kind).kind in "biufc")) and all(
        type(value) is kind for value in values)


# -- the stream ---------------------------------------------------------------------------------------------
class ShardedStream(IterableDataset):
    """Training data as shards of known sizes and `read(shard)`, an iterator of that shard's (x, y) samples in
    order. `len()` is the number of samples. `plan(...)` fixes this rank's reading; iterating yields the batches
    of the epoch set by `set_epoch`, from its step `start` on. `name`: what --data was, for messages."""

    is_stream = True

    def __init__(self, shards: list[Shard], read: Callable[[Shard], Iterable], name: str,
                 collate: Optional[Callable] = None, staging=None) -> None:
        self.shards, self.read, self.name = list(shards), read, name
        self.collate = collate
        self.staging = staging  # --stage-to (dptrain.data.staging): each shard read from its copy once complete
        if staging is not None:
            self.read = _FromCopies(read, staging)
        self.labels: Optional[np.ndarray] = None  # every sample's label in file order, where known
        self.rank, self.world, self.workers, self.steps, self.seed, self.shuffle = 0, 1, 0, 1, 0, "global"
        self.epoch = self.start = 0
        self.rest: Optional[StreamRest] = None  # the rest of an epoch shared out again over this world

    def __len__(self) -> int:
        return sum(shard.samples for shard in self.shards)

    def plan(self, rank: int, world: int, workers: int, batch_size: int, seed: int, shuffle: str,
             rest: Optional[StreamRest] = None) -> int:
        """Fix this rank's reading; returns the steps of every epoch (the same on every rank). `rest`: the rest of
        an epoch shared out over this world (this rank reads its part `rest.parts[rank]` in that epoch)."""
        self.rank, self.world, self.workers, self.seed, self.shuffle = rank, world, workers, seed, shuffle
        self.steps = sharding.steps_per_epoch(len(self), world, batch_size)
        self.rest = rest
        return self.steps

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start
        if self.staging is not None:  # the first epoch read begins: the copy begins, in the node's reading order
            self.staging.start(copy_order([shard.samples for shard in self.shards], epoch, self.seed, self.shuffle,
                                          _node_ranks(self.rank, self.world), self.world))

    def _rest(self) -> Optional[StreamRest]:
        return self.rest if self.rest is not None and self.rest.epoch == self.epoch else None

    def remaining(self) -> int:
        """The steps of the epoch from its start on (of its rest, where one is shared out)."""
        rest = self._rest()
        return (rest.done + rest.steps if rest is not None else self.steps) - self.start

    def segments(self, epoch: int, rank: Optional[int] = None) -> list[tuple[int, int, int]]:
        """A rank's (shard, first, stop) pieces of `epoch` (this rank's by default)."""
        order = shard_order(len(self.shards), epoch, self.seed, self.shuffle)
        return rank_segments([shard.samples for shard in self.shards], order,
                             self.rank if rank is None else rank, self.world)

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        workers = info.num_workers if info is not None else 1
        worker = info.id if info is not None else 0
        rest = self._rest()
        segments, steps, begun = self.segments(self.epoch), self.steps, 0
        if rest is not None:  # its steps from rest.done on: this rank's part of what no rank had read by then
            order = shard_order(len(self.shards), self.epoch, self.seed, self.shuffle)
            segments = position_pieces([shard.samples for shard in self.shards], order, rest.parts[self.rank])
            steps, begun = rest.steps, rest.done
        if not steps:
            return
        role = (worker + self.start - begun) % workers  # the first batch fetched (worker 0's) is step `start`'s
        sizes = batch_sizes(sum(stop - first for _, first, stop in segments), steps)
        pieces, mine = worker_part(segments, sizes, role, workers)
        skip = sum(1 for step in range(self.start - begun) if step % workers == role)
        rng = reading_rng(self.seed, self.epoch, self.rank, role, self.shuffle, begun)
        samples = shuffled(self._pieces(pieces), SHUFFLE_BUFFER, rng)
        dropped = sum(mine[:skip])  # a resumed epoch: the batches before its start, read and dropped
        if dropped:
            next(islice(samples, dropped - 1, None))
        for size in mine[skip:]:
            batch = list(islice(samples, size))
            if len(batch) != size:
                raise RuntimeError(f"a batch of {size} samples had {len(batch)}: the plan and the shards disagree")
            yield self.collate(batch) if self.collate is not None else batch

    def _pieces(self, pieces: list[tuple[int, int, int]]) -> Iterator:
        """The samples of `pieces`; pieces of one shard that follow each other (ascending) in one read of it, each
        piece's samples passed on by itertools (no Python per sample) and counted."""
        for index, same in groupby(pieces, key=lambda piece: piece[0]):
            shard, at = self.shards[index], 0
            samples = iter(self.read(shard))
            for _, first, stop in same:
                counted = count()  # zip counts the samples it takes (count() moves only when one came)
                deque(zip(islice(samples, first - at), counted), maxlen=0)  # the samples before the piece, dropped
                yield from map(itemgetter(0), zip(islice(samples, stop - first), counted))
                read, at = at + next(counted), stop
                if read < stop:
                    raise UserError(f"--data {self.name}: rank {self.rank} read {read} samples of shard "
                                    f"'{shard.name}' where {shard.samples} were counted before training (it changed "
                                    "on disk, or it yields other samples on this rank or in a loader worker); every "
                                    "rank must read the same samples of it")

    def first(self) -> tuple:
        """The first sample of the first shard that holds any."""
        shard = next(shard for shard in self.shards if shard.samples)
        return next(iter(self.read(shard)))

    def probe(self, rows: int) -> list[tuple]:
        """The first `rows` samples in file order, as one batch (the average check's probe)."""
        taken: list = []
        for shard in self.shards:
            for sample in self.read(shard):
                if len(taken) >= rows:
                    break
                taken.append(sample)
            if len(taken) >= rows:
                break
        return [self.collate(taken)] if self.collate is not None else [taken]

    def fingerprint(self) -> dict:
        """The shards' file names (not their folders: a run continued from elsewhere, or from a staged copy, reads
        the same shards) and sizes, hashed: another set of shards is other data."""
        digest = hashlib.sha256(f"rows={len(self)}".encode())
        for shard in self.shards:
            digest.update(f"{os.path.basename(shard.name)}\0{shard.samples}\n".encode())
        return {"rows": len(self), "sha256": digest.hexdigest()}


def _node_ranks(rank: int, world: int) -> range:
    """The ranks of this process's node, as the launcher's LOCAL_RANK and LOCAL_WORLD_SIZE say (all, where not)."""
    local, size = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if local is None or size is None:
        return range(world)
    first = max(0, rank - int(local))
    return range(first, min(world, first + int(size)))


class _FromCopies:
    """A reader of shards that opens each one's --stage-to copy when it is complete, its original otherwise."""

    def __init__(self, read: Callable[[Shard], Iterable], staging) -> None:
        self.reader, self.staging = read, staging

    def __call__(self, shard: Shard) -> Iterable:
        return self.reader(Shard(self.staging.where(shard.name), shard.samples))


def refuse_stream_run(strategy: str, own_partitions: bool, other_world: bool, min_workers=None,
                      merges: bool = False) -> None:
    """One line for what a stream cannot do yet: a strategy with partitions of its own (fedavg: give each client
    its own data instead, a factory taking `rank`), --strategy auto (it times map-style batches), live membership
    where the workers meet only in merges (`merges`: async shares the data out again from an epoch each worker
    reaches on its own, where a stream's plan is made over the world all ranks train in at once) and the rest of
    an epoch resumed on another number of workers (`other_world`). Live membership of the others is planned
    again over the new world: from the next epoch's start, or from a commit with the rest shared (StreamRest)."""
    if own_partitions:
        raise UserError(f"--strategy {strategy} keeps its own partitions of map-style data, and shards are read as a "
                        "stream; give each client its own data (a --data factory taking rank), or use allreduce, "
                        "sync, streaming or async")
    if strategy == "auto":
        raise UserError("--strategy auto times map-style batches; with shards name the strategy (e.g. allreduce)")
    if min_workers is not None and merges:
        raise UserError(f"--min-workers {min_workers} with --strategy {strategy}: its workers share the data out "
                        "again from an epoch each reaches on its own, and shards read as a stream are shared out "
                        "at an epoch all workers stand at; use sync, streaming, hierarchical or allreduce, or drop "
                        "--min-workers")
    if other_world:
        raise UserError("this checkpoint within an epoch was written by another number of workers, and shards read "
                        "as a stream go on within an epoch only on the same number; resume with as many workers")


class StreamReader:
    """A rank's batches of a ShardedStream through a DataLoader (`workers` processes): len() is the epoch's steps
    from its start; `set_epoch(epoch, start)` as PlanBatches'."""

    def __init__(self, stream: ShardedStream, workers: int, pin_memory: bool = False) -> None:
        self.stream = stream
        self.loader = DataLoader(stream, batch_size=None, num_workers=workers, pin_memory=pin_memory)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.stream.set_epoch(epoch, start)

    def __len__(self) -> int:
        return self.stream.remaining()

    def __iter__(self) -> Iterator:
        return iter(self.loader)


def is_stream(data: Any) -> bool:
    return getattr(data, "is_stream", False) is True

