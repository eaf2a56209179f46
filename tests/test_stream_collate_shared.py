"""In a loader worker the stream reader's batches are stacked straight into shared memory, as default_collate's
are (dptrain.data.streams.collate_pairs), with the values, types and order they have outside a worker."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stream_data import write_parquets, write_tars
from test_stream_reader_batches import LABELS
from torch.utils.data import DataLoader, IterableDataset

from dptrain.data.sampler import collate_items
from dptrain.data.shard_files import open_shards
from dptrain.data.streams import StreamReader, collate_pairs

DTYPES = (np.float32, np.float64, np.float16, np.uint8, np.int32, np.int64, np.bool_, np.complex64)


def _batch(dtype, label: str) -> list:
    return [((np.arange(12).reshape(3, 4) * (i + 1) / 7).astype(dtype), LABELS[label](i)) for i in range(5)]


class _Collated(IterableDataset):
    """Each (dtype, label) batch collated by collate_pairs where this runs, and whether x and y are shared."""

    def __iter__(self):
        for dtype in DTYPES:
            for label in sorted(LABELS):
                x, y = collate_pairs(_batch(dtype, label))
                yield x, y, x.is_shared(), y.is_shared()


def test_a_workers_batches_are_in_shared_memory_with_the_values_and_types_of_the_main_process():
    here = [(x, y) for x, y, _, _ in _Collated()]
    there = list(DataLoader(_Collated(), batch_size=None, num_workers=1))
    assert len(there) == len(here) == len(DTYPES) * len(LABELS)
    for (x, y), (wx, wy, x_shared, y_shared) in zip(here, there):
        assert bool(x_shared) and bool(y_shared)  # made in shared memory in the worker: sent without a copy
        assert not x.is_shared() and not y.is_shared()  # outside a worker: plain memory, as before
        assert (wx.dtype, wy.dtype, wx.shape, wy.shape) == (x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(wx, x) and torch.equal(wy, y)


@pytest.mark.parametrize("write", [write_tars, write_parquets])
def test_the_readers_batches_through_two_workers_are_default_collates_in_the_same_order(tmp_path, write):
    stream = open_shards(str(tmp_path / write(tmp_path / "shards")))
    stream.plan(0, 1, 2, 8, seed=3, shuffle="global")
    batches = {}
    for collate in (collate_pairs, collate_items):  # collate_items: default_collate's, per sample
        stream.collate = collate
        reader = StreamReader(stream, 2)
        reader.set_epoch(1)
        batches[collate] = list(reader)
    assert stream.collate is collate_items and len(batches[collate_pairs]) == 10  # (80 samples in batches of 8)
    assert sorted(int(i) for x, _ in batches[collate_pairs] for i in x[:, 0]) == list(range(80))
    for (x, y), (ex, ey) in zip(batches[collate_pairs], batches[collate_items]):
        assert (x.dtype, y.dtype) == (ex.dtype, ey.dtype) == (torch.float32, torch.int64)
        assert torch.equal(x, ex) and torch.equal(y, ey)
