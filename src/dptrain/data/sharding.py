"""Which samples each worker sees in each epoch, in which order: one rule for every strategy.

Pure functions of (sample count, rank, world, epoch, seed), so every strategy gives a worker
the same shard and order for a given seed, and tests can rebuild any worker's batches.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from dptrain.data.dstensor import DSTensor
from dptrain.errors import UserError

SHUFFLES = ("global", "block", "local", "none")


def derive_seed(seed: int, *path: int) -> int:
    """An independent 63-bit seed for each (seed, epoch[, rank]) tuple.

    The path goes into spawn_key, not the entropy list: entropy words are 32-bit and
    zero-padded, so (2**32, 0) and (0, 1) would collide there.
    """
    sequence = np.random.SeedSequence(int(seed), spawn_key=tuple(int(p) for p in path))
    return int(sequence.generate_state(2, np.uint64)[0] >> np.uint64(1))


def check_workers(n_samples: int, world: int) -> None:
    """Every worker needs at least one sample."""
    if n_samples < world:
        raise UserError(f"the training set has {n_samples} samples, fewer than the {world} workers; "
                        f"use at most {n_samples} workers")


def steps_per_epoch(n_samples: int, world: int, batch_size: int) -> int:
    """Steps every worker takes per epoch: the same on all workers, or allreduce would hang.

    Shards differ by at most one sample; each is cut into this many near-equal batches, so
    no sample is dropped or repeated and no batch exceeds batch_size (except by one sample
    when batch_size is 1 and the shards are unequal).
    """
    check_workers(n_samples, world)
    largest, smallest = math.ceil(n_samples / world), n_samples // world
    return max(1, min(math.ceil(largest / batch_size), smallest))


def epoch_indices(n_samples: int, rank: int, world: int, epoch: int, seed: int, shuffle: str = "global",
                  block_size: Optional[int] = None) -> np.ndarray:
    """Sample indices worker `rank` visits in `epoch`, in visiting order.

    global: a fresh permutation of all samples each epoch (DSTensor.shuffle), then the
    worker's contiguous slice of it; block: a fresh order of the data's blocks of `block_size`
    samples (DSTensor's default when None) and a permutation inside each (DSTensor.block_shuffle),
    then the worker's slice; local: the worker keeps the same shard for the whole run and
    permutes it each epoch; none: the same shard in file order.
    """
    if shuffle not in SHUFFLES:
        raise ValueError(f"shuffle must be one of {SHUFFLES}, not {shuffle!r}")
    order = DSTensor.from_array(np.arange(n_samples), block_size=block_size if shuffle == "block" else None)
    if shuffle == "global":
        order = order.shuffle(derive_seed(seed, epoch))
    elif shuffle == "block":
        order = order.block_shuffle(derive_seed(seed, epoch))
    shard = order.shard(rank, world).to_numpy()
    if shuffle == "local":
        shard = shard[np.random.default_rng(derive_seed(seed, epoch, rank)).permutation(len(shard))]
    return shard


def batches(indices: np.ndarray, steps: int) -> list[np.ndarray]:
    return np.array_split(indices, steps)
