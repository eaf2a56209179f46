"""DSTensor: no sample is ever lost or duplicated, shuffles are real and reproducible, reads are lazy."""

import pickle

import h5py
import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from dptrain.data import DSTensor
from dptrain.errors import UserError


def labelled(n, trailing=(3, 2, 2)):
    """Rows whose every entry is the row number, so read data reveals which source row it came from."""
    return np.broadcast_to(np.arange(n, dtype=np.float32).reshape(n, *[1] * len(trailing)), (n, *trailing)).copy()


def rows_in(data):
    return data.reshape(len(data), -1)[:, 0].astype(np.int64) if len(data) else np.zeros(0, np.int64)


def source_rows(t):
    """Source row of every logical sample, in logical order (the tensor's index of its source)."""
    return t._logical_rows().copy()


def check_consistent(t):
    """Blocks tile the samples, and the data read agrees with source_rows."""
    assert all(length > 0 for length in t.block_lengths)
    assert sum(t.block_lengths) == t.n_samples == len(t)
    assert np.array_equal(rows_in(t.to_numpy()), source_rows(t))
    if t.n_blocks:
        blocks = np.concatenate([t.block(i) for i in range(t.n_blocks)])
        assert np.array_equal(rows_in(blocks), source_rows(t))


operation = st.one_of(
    st.tuples(st.just("shuffle"), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("local_shuffle"), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("block_shuffle"), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("rechunk"), st.integers(1, 40)),
    st.tuples(st.just("shard"), st.integers(1, 7), st.integers(0, 6)),
)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 200), block_size=st.integers(1, 50), ops=st.lists(operation, max_size=6))
def test_no_sample_lost_or_duplicated_through_any_chain(n, block_size, ops):
    t = DSTensor.from_array(labelled(n), block_size=block_size)
    for op in ops:
        before = source_rows(t)
        if op[0] == "shard":
            world = op[1]
            shards = [t.shard(r, world) for r in range(world)]
            sizes = [len(s) for s in shards]
            assert max(sizes) - min(sizes) <= 1
            assert np.array_equal(np.concatenate([source_rows(s) for s in shards]), before)
            t = shards[op[2] % world]
        else:
            t = getattr(t, op[0])(op[1])
            assert np.array_equal(np.sort(source_rows(t)), np.sort(before))
        assert len(np.unique(source_rows(t))) == len(t)
        check_consistent(t)


def test_shard_blocks_are_intersections_with_the_blocks():
    t = DSTensor.from_array(np.arange(20), block_size=6)
    assert t.block_lengths == (6, 6, 6, 2)
    assert t.shard(1, 3).block_lengths == (6, 1)
    assert np.array_equal(t.shard(1, 3).to_numpy(), np.arange(6, 13))
    assert t.shard(2, 3).block_lengths == (5, 2)


def test_shuffle_moves_samples_across_blocks():
    n, block_size = 1000, 100
    t = DSTensor.from_array(np.arange(n), block_size=block_size)
    shuffled = t.shuffle(seed=3).to_numpy()
    block_now = np.arange(n) // block_size
    block_before = shuffled // block_size
    # A real permutation keeps about 1/10 of samples in their old block, a block swap keeps none or all.
    assert 0.03 < np.mean(block_now == block_before) < 0.2
    assert np.array_equal(np.sort(shuffled), np.arange(n))


def test_shuffle_is_reproducible_from_the_seed():
    t = DSTensor.from_array(np.arange(500), block_size=64)
    assert np.array_equal(t.shuffle(7).to_numpy(), t.shuffle(7).to_numpy())
    assert not np.array_equal(t.shuffle(7).to_numpy(), t.shuffle(8).to_numpy())
    assert np.array_equal(t.shuffle(7).to_numpy(), np.random.default_rng(7).permutation(500))
    assert t.shuffle(7).block_lengths == t.block_lengths


def test_block_shuffle_reorders_whole_blocks_and_the_samples_inside_each():
    t = DSTensor.from_array(labelled(100), block_size=10)
    shuffled = t.block_shuffle(3)
    rows = rows_in(shuffled.to_numpy())
    assert sorted(rows.tolist()) == list(range(100))
    runs = rows.reshape(10, 10) // 10  # consecutive tens come from one source block
    assert all(len(set(run)) == 1 for run in runs.tolist())
    assert sorted(run[0] for run in runs.tolist()) == list(range(10))
    assert runs[:, 0].tolist() != list(range(10))  # the blocks are reordered
    assert not np.array_equal(rows.reshape(10, 10).min(axis=1), rows.reshape(10, 10)[:, 0])  # and shuffled inside
    assert np.array_equal(rows, rows_in(t.block_shuffle(3).to_numpy()))
    assert not np.array_equal(rows, rows_in(t.block_shuffle(4).to_numpy()))


def test_local_shuffle_keeps_block_membership_and_is_reproducible():
    t = DSTensor.from_array(np.arange(1000), block_size=100).shuffle(1)
    local = t.local_shuffle(5)
    assert local.block_lengths == t.block_lengths
    for i in range(t.n_blocks):
        assert np.array_equal(np.sort(local.block(i)), np.sort(t.block(i)))
    assert not np.array_equal(local.to_numpy(), t.to_numpy())
    assert np.array_equal(local.to_numpy(), t.local_shuffle(5).to_numpy())
    assert not np.array_equal(local.to_numpy(), t.local_shuffle(6).to_numpy())


def test_rechunk_keeps_samples_and_order():
    t = DSTensor.from_array(np.arange(103), block_size=10).shuffle(2)
    r = t.rechunk(25)
    assert r.block_lengths == (25, 25, 25, 25, 3)
    assert r.block_size == 25
    assert np.array_equal(r.to_numpy(), t.to_numpy())


def test_x_y_pairs_stay_aligned_under_the_same_seeds():
    n = 257
    x = DSTensor.from_array(labelled(n, (3, 8, 8)), block_size=32)
    y = DSTensor.from_array(np.arange(n) * 10, block_size=32)
    for seed in range(3):
        x, y = x.shuffle(seed).local_shuffle(seed + 100), y.shuffle(seed).local_shuffle(seed + 100)
    xs, ys = x.shard(2, 3), y.shard(2, 3)
    assert xs.shape == (len(ys), 3, 8, 8)
    assert np.array_equal(rows_in(xs.to_numpy()) * 10, ys.to_numpy())


def test_take_returns_rows_in_any_order_and_reads_each_once():
    t = DSTensor.from_array(labelled(50, (2,)), block_size=8).shuffle(4)
    idx = [7, 3, 3, 49, 0, 7]
    before = t.rows_read
    out = t.take(idx)
    assert np.array_equal(out, t.to_numpy()[idx])
    assert t.rows_read - before - 50 == 4  # to_numpy read 50 rows, take read 4 unique rows
    with pytest.raises(IndexError):
        t.take([50])


def test_slice_and_subset():
    t = DSTensor.from_array(np.arange(30), block_size=8)
    assert np.array_equal(t.slice(5, 20).to_numpy(), np.arange(5, 20))
    assert t.slice(5, 20).block_lengths == (3, 8, 4)
    sub = t.subset([29, 0, 4])
    assert np.array_equal(sub.to_numpy(), [29, 0, 4])
    assert sub.block_lengths == (3,)


def test_results_are_copies_that_cannot_change_the_source():
    array = np.arange(10)
    t = DSTensor.from_array(array, block_size=4)
    t.block(0)[:] = -1
    t.to_numpy()[:] = -1
    assert np.array_equal(array, np.arange(10))


def test_from_torch_tensor_and_trailing_shapes():
    t = DSTensor.from_array(torch.arange(24.0).reshape(6, 2, 2))
    assert t.shape == (6, 2, 2)
    assert t.dtype == np.float32
    assert t.block_size == 6 and t.n_blocks == 1
    assert "shape=(6, 2, 2)" in repr(t)


def test_default_block_size():
    assert DSTensor.from_array(np.zeros(5000)).block_size == 1024
    assert DSTensor.from_array(np.zeros(5000)).block_lengths[-1] == 5000 - 4 * 1024
    empty = DSTensor.from_array(np.zeros((0, 3)))
    assert empty.n_blocks == 0 and empty.shape == (0, 3) and empty.to_numpy().shape == (0, 3)


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_block_size_is_a_user_error(bad):
    with pytest.raises(UserError, match=repr(bad)):
        DSTensor.from_array(np.arange(10), block_size=bad)
    with pytest.raises(UserError, match=repr(bad)):
        DSTensor.from_array(np.arange(10)).rechunk(bad)


def test_bad_rank_or_world_is_a_programming_error():
    t = DSTensor.from_array(np.arange(10))
    for rank, world in [(4, 4), (-1, 4), (0, 0)]:
        with pytest.raises(ValueError):
            t.shard(rank, world)


def test_scalar_is_a_user_error():
    with pytest.raises(UserError, match="scalar"):
        DSTensor.from_array(np.float32(3))


# ------------------------------------------------------------------------ files


def write_npy(path, array):
    np.save(path, array)
    return path


def write_h5(path, array):
    with h5py.File(path, "w") as f:
        f["x"] = array
        f["y"] = np.arange(len(array))
    return path


def write_zarr(path, array):
    group = zarr.open_group(str(path), mode="w")
    group.create_array("x", data=array, chunks=(16, *array.shape[1:]))
    return path


def write_zarr_zip(path, array):
    store = zarr.storage.ZipStore(str(path), mode="w")
    group = zarr.open_group(store=store, mode="w")
    group.create_array("x", data=array)
    store.close()
    return path


FILE_KINDS = {
    "npy": ("data.npy", write_npy, None),
    "h5": ("data.h5", write_h5, "x"),
    "zarr": ("data.zarr", write_zarr, "x"),
    "zarr-zip": ("data.zarr.zip", write_zarr_zip, "x"),
}


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_file_shard_reads_only_its_rows(tmp_path, kind):
    name, write, key = FILE_KINDS[kind]
    array = labelled(400, (3, 4, 4))
    path = write(tmp_path / name, array)
    t = DSTensor.from_file(path, key=key, block_size=32)
    assert t.shape == array.shape and t.dtype == np.float32
    part = t.shard(1, 4).to_numpy()
    assert np.array_equal(part, array[100:200])
    assert t.rows_read == 100
    shuffled = t.shuffle(9).shard(3, 4)
    assert np.array_equal(shuffled.to_numpy(), array[source_rows(shuffled)])
    assert t.rows_read == 200


@pytest.mark.parametrize("kind", ["npy", "h5", "zarr"])
def test_file_tensor_pickles_by_reopening(tmp_path, kind):
    name, write, key = FILE_KINDS[kind]
    array = labelled(40)
    t = DSTensor.from_file(write(tmp_path / name, array), key=key, block_size=8).shuffle(1).shard(0, 2)
    payload = pickle.dumps(t)
    assert len(payload) < array.nbytes
    assert np.array_equal(pickle.loads(payload).to_numpy(), t.to_numpy())


def test_contiguous_hdf5_datasets_are_memory_mapped_and_read_what_h5py_reads(tmp_path):
    array = labelled(30, (4,))
    path = tmp_path / "d.h5"
    with h5py.File(path, "w", userblock_size=4096) as f:  # a user block moves every offset
        f["contiguous"] = array
        f["labels"] = np.arange(30, dtype=np.int16)
        f["big_endian"] = array.astype(">f4")
        f.create_dataset("chunked", data=array, chunks=(5, 4), compression="gzip")
        f.create_dataset("unwritten", shape=(30, 4), dtype=np.float32)
        f["strings"] = np.array([b"a", b"b"] * 15)
    mapped = {"contiguous", "labels", "big_endian"}
    with h5py.File(path, "r") as f:
        for key in f:
            t = DSTensor.from_file(path, key, block_size=8)
            assert isinstance(t._source, np.memmap) == (key in mapped), key
            if key == "strings":
                continue
            shuffled = t.shuffle(3)
            assert t.dtype == f[key].dtype
            assert np.array_equal(shuffled.to_numpy(), f[key][:][source_rows(shuffled)]), key
            assert np.array_equal(pickle.loads(pickle.dumps(shuffled)).to_numpy(), shuffled.to_numpy())


def test_npz_member_by_key(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.arange(12).reshape(6, 2), labels=np.arange(6))
    t = DSTensor.from_file(tmp_path / "d.npz", key="labels", block_size=4)
    assert np.array_equal(t.to_numpy(), np.arange(6))


def test_zarr_single_array_needs_no_key(tmp_path):
    zarr.save_array(str(tmp_path / "a.zarr"), np.arange(7))
    assert np.array_equal(DSTensor.from_file(tmp_path / "a.zarr").to_numpy(), np.arange(7))
    with pytest.raises(UserError, match="'x' does not apply"):
        DSTensor.from_file(tmp_path / "a.zarr", key="x")


def test_file_errors_name_the_file_and_what_is_valid(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.arange(3), labels=np.arange(3))
    write_h5(tmp_path / "d.h5", np.zeros((3, 2)))
    write_zarr(tmp_path / "d.zarr", np.zeros((3, 2)))
    np.save(tmp_path / "d.npy", np.arange(3))
    (tmp_path / "d.csv").write_text("1,2\n")
    cases = [
        (tmp_path / "missing.npy", None, "does not exist"),
        (tmp_path / "d.csv", None, r"unsupported extension; use one of: \.npy"),
        (tmp_path / "d.npz", None, "needs a key naming the array to read; it holds: x, labels"),
        (tmp_path / "d.npz", "y", "has no array 'y'; it holds: x, labels"),
        (tmp_path / "d.h5", "z", "has no array 'z'; it holds: x, y"),
        (tmp_path / "d.zarr", "z", "has no array 'z'; it holds: x"),
        (tmp_path / "d.npy", "x", "key 'x' does not apply"),
    ]
    for path, key, message in cases:
        with pytest.raises(UserError, match=message) as info:
            DSTensor.from_file(path, key=key)
        assert path.name in str(info.value)


@pytest.mark.parametrize("kind", ["zarr", "h5-chunked"])
def test_block_shuffled_batches_of_a_chunked_file_read_each_block_once(tmp_path, kind):
    array = labelled(400, (3, 4, 4))
    if kind == "zarr":
        path, key = write_zarr(tmp_path / "data.zarr", array), "x"
    else:  # chunked HDF5 is read through h5py (a contiguous one is memory-mapped instead)
        import h5py
        path, key = tmp_path / "data.h5", "x"
        with h5py.File(path, "w") as handle:
            handle.create_dataset("x", data=array, chunks=(10, 3, 4, 4))
    t = DSTensor.from_file(path, key=key, block_size=100).block_shuffle(5)
    rows = source_rows(t)
    batches = [t.take(np.arange(start, start + 20)) for start in range(0, 400, 20)]  # 5 batches a block
    assert np.array_equal(np.concatenate(batches), array[rows])  # the same rows as reading them one by one
    assert t.rows_read == 400  # each 100-row block read once, not once per batch
