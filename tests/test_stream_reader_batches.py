"""The stream reader's batch-level work (dptrain.data.streams, shard_files) gives what its per-sample form gave:
the shuffle buffer's order, default_collate's values and types, pyarrow's rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from dptrain.data.sampler import collate_items
from dptrain.data.shard_files import read_parquet
from dptrain.data.streams import Shard, collate_pairs, shuffled


def one_at_a_time(samples, buffer, rng):
    """The shuffle buffer as written first, a sample at a time: the reference for its order."""
    held, draws, next_draw = [], np.empty(0, dtype=np.int64), 0
    for sample in samples:
        if len(held) < buffer:
            held.append(sample)
            continue
        if next_draw == len(draws):
            draws, next_draw = rng.integers(buffer, size=1024), 0
        index = draws[next_draw]
        next_draw += 1
        held[index], sample = sample, held[index]
        yield sample
    for index in rng.permutation(len(held)):
        yield held[index]


@pytest.mark.parametrize("samples", [0, 1, 1023, 1024, 1025, 2048, 2049, 3100, 6000])
@pytest.mark.parametrize("buffer", [2, 16, 1024])
def test_the_shuffle_buffer_gives_the_order_of_one_sample_at_a_time(samples, buffer):
    for seed in (0, 1):
        expected = list(one_at_a_time(range(samples), buffer, np.random.default_rng(seed)))
        assert list(shuffled(range(samples), buffer, np.random.default_rng(seed))) == expected


LABELS = {"int": lambda i: i % 3, "bool": lambda i: bool(i % 2), "float": lambda i: i / 7,
          "int64": lambda i: np.int64(i), "float32": lambda i: np.float32(i / 3),
          "vector": lambda i: np.array([i, i + 1.5], dtype=np.float64)}


@pytest.mark.parametrize("label", sorted(LABELS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint8, np.int32])
def test_numpy_batches_collate_to_default_collates_values_and_types(label, dtype):
    batch = [(np.arange(12, dtype=dtype).reshape(3, 4) + i, LABELS[label](i)) for i in range(5)]
    x, y = collate_pairs(batch)
    ex, ey = collate_items(batch)  # default_collate, then dptrain's types (float32 inputs, int64 labels)
    assert x.dtype == ex.dtype and y.dtype == ey.dtype and torch.equal(x, ex) and torch.equal(y, ey)


def test_other_batches_go_to_default_collate():
    tensors = [(torch.ones(2) * i, i) for i in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(collate_pairs(tensors), default_collate(tensors)))
    mixed = [(np.ones(2), 1), (np.ones(2), 2.5)]  # labels of two types: default_collate's rule, not numpy's
    assert collate_pairs(mixed)[1].dtype == collate_items(mixed)[1].dtype


@pytest.mark.parametrize("rows", [
    [[1.5, 2.0, 3.0], [4.0, 5.0, 6.25], [7.0, 8.0, 9.0]],  # one length: one conversion a record batch
    [[1.0, 2.0], [3.0], [4.0, 5.0, 6.0]],  # ragged: pyarrow's rows one by one
])
def test_parquet_rows_are_pyarrows_rows_as_float32(tmp_path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": pa.array(rows, type=pa.list_(pa.float64())), "y": [0, 1, 2]}),
                   tmp_path / "part.parquet")
    read = list(read_parquet(Shard(str(tmp_path / "part.parquet"), 3)))
    assert [y for _, y in read] == [0, 1, 2]
    for (x, _), row in zip(read, rows):
        assert x.dtype == np.float32 and x.tolist() == np.asarray(row, dtype=np.float32).tolist()
        assert x.base is None or x.base.size == x.size  # a copy of its own: a held sample holds only itself
