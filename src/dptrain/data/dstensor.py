"""DSTensor: a dataset as a grid of blocks along the sample axis, read lazily so each worker touches only its rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dptrain.errors import UserError

DEFAULT_BLOCK_SIZE = 1024
FILE_SUFFIXES = (".npy", ".npz", ".h5", ".hdf5", ".zarr")


class _ReadCounter:
    """Source rows read, shared by a DSTensor and every tensor derived from it, and the window of
    source rows last read whole from a chunked file (see DSTensor._window)."""

    def __init__(self) -> None:
        self.rows = 0
        self.window: tuple[int, np.ndarray] | None = None  # (first source row, its rows)

    def __getstate__(self) -> dict:  # a copy sent to a DataLoader worker starts without the window
        return {"rows": self.rows, "window": None}


class DSTensor:
    """An immutable dataset split into blocks along axis 0, backed by an array or a file.

    Internally a DSTensor is a *source* (numpy array, read-only memmap of an ``.npy`` file or
    of a contiguous HDF5 dataset, h5py Dataset or zarr Array), an optional *index* mapping
    logical sample ``i`` to source row ``index[i]`` (``None`` means identity) and the *block
    lengths*. Every transformation (``shuffle``, ``local_shuffle``, ``rechunk``, ``shard``,
    ``slice``, ``subset``) only computes a new index and new block lengths; rows are read from
    the source on demand (``block``, ``take``, ``to_numpy``), so a worker reads only the rows
    it is given.

    Invariant: a transformation never loses or duplicates a sample; ``shuffle`` and
    ``local_shuffle`` are permutations, ``rechunk`` keeps the order, and ``shard`` /
    ``slice`` / ``subset`` select exactly the requested samples.

    ``rows_read`` counts source rows read by this tensor and all tensors derived from it.
    """

    def __init__(
        self,
        source: Any,
        index: np.ndarray | None,
        block_lengths: tuple[int, ...],
        block_size: int,
        counter: _ReadCounter,
        origin: tuple[str, str | None] | None = None,
    ) -> None:
        # Use the constructors (from_array, from_file); this one trusts its arguments.
        self._source = source
        self._index = index
        self._lengths = block_lengths
        self._block_size = block_size
        self._counter = counter
        # (path, key) of a file source, so a pickled tensor reopens the file instead of copying it.
        self._origin = origin
        self._offsets = np.concatenate(([0], np.cumsum(block_lengths, dtype=np.int64)))

    # ----------------------------------------------------------------- constructors

    @classmethod
    def from_array(cls, array: Any, block_size: int | None = None) -> DSTensor:
        """Wrap a numpy array or torch tensor (not copied; do not modify it afterwards).

        ``block_size`` defaults to ``min(n_samples, 1024)``.
        """
        if hasattr(array, "detach") and hasattr(array, "numpy"):
            array = array.detach().cpu().numpy()
        array = np.asarray(array)
        return cls._from_source(array, block_size, origin=None, what="array")

    @classmethod
    def from_file(cls, path: str | Path, key: str | None = None, block_size: int | None = None) -> DSTensor:
        """Open an array in a file lazily.

        - ``.npy``: memory-mapped read-only; ``key`` must be None.
        - ``.npz``: member ``key`` (required). numpy loads an npz member whole into memory.
        - ``.h5`` / ``.hdf5``: dataset ``key`` (required); memory-mapped read-only when the dataset is
          contiguous (h5py's default) and of a numeric dtype, otherwise read through h5py
          from the file, which stays open read-only.
        - ``.zarr`` (directory or zip file): array ``key`` in a group, or the array itself
          when the store holds a single array and ``key`` is None.
        """
        source = _open_source(Path(path), key)
        origin = (str(Path(path).absolute()), key)
        return cls._from_source(source, block_size, origin=origin, what=f"data file '{path}'")

    @classmethod
    def _from_source(
        cls, source: Any, block_size: int | None, origin: tuple[str, str | None] | None, what: str
    ) -> DSTensor:
        if len(source.shape) == 0:
            raise UserError(f"{what} is a scalar (shape ()); a dataset needs a sample axis, shape (n, ...).")
        n = int(source.shape[0])
        size = max(1, min(n, DEFAULT_BLOCK_SIZE)) if block_size is None else _check_block_size(block_size)
        return cls(source, None, _even_blocks(n, size), size, _ReadCounter(), origin)

    def _derive(self, index: np.ndarray | None, block_lengths: tuple[int, ...], block_size: int | None = None) -> DSTensor:
        return DSTensor(
            self._source,
            index,
            block_lengths,
            self._block_size if block_size is None else block_size,
            self._counter,
            self._origin,
        )

    # ------------------------------------------------------------------- properties

    @property
    def n_samples(self) -> int:
        return int(self._offsets[-1])

    def __len__(self) -> int:
        return self.n_samples

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n_samples, *(int(d) for d in self._source.shape[1:]))

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._source.dtype)

    @property
    def n_blocks(self) -> int:
        return len(self._lengths)

    @property
    def block_size(self) -> int:
        """Nominal block size; the last block, and blocks cut by ``shard``/``slice``, may be shorter."""
        return self._block_size

    @property
    def block_lengths(self) -> tuple[int, ...]:
        return self._lengths

    @property
    def rows_read(self) -> int:
        return self._counter.rows

    def __repr__(self) -> str:
        kind = type(self._source).__name__ if self._origin is None else f"'{self._origin[0]}'"
        if self._origin is not None and self._origin[1] is not None:
            kind += f"[{self._origin[1]!r}]"
        order = "source order" if self._index is None else "indexed"
        return (
            f"DSTensor(shape={self.shape}, dtype={self.dtype}, n_blocks={self.n_blocks}, "
            f"block_size={self.block_size}, source={kind}, {order})"
        )

    # ---------------------------------------------------------------------- reading

    def block_range(self, i: int) -> tuple[int, int]:
        """Logical ``[start, stop)`` of block ``i``."""
        if not 0 <= i < self.n_blocks:
            raise IndexError(f"block {i} out of range for {self.n_blocks} blocks")
        return int(self._offsets[i]), int(self._offsets[i + 1])

    def block(self, i: int) -> np.ndarray:
        """The rows of block ``i``, read from the source."""
        start, stop = self.block_range(i)
        return self.take(np.arange(start, stop))

    def take(self, idx: Any) -> np.ndarray:
        """Rows at logical indices ``idx`` (any order, repeats allowed), reading only those rows."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n_samples):
            raise IndexError(f"indices must lie in [0, {self.n_samples}); got {idx.min()}..{idx.max()}")
        rows = idx if self._index is None else self._index[idx]
        # h5py needs strictly increasing indices, and sorted reads are the fast path for every source.
        unique_rows, inverse = np.unique(rows, return_inverse=True)
        data = self._read_sorted(unique_rows)
        if unique_rows.size == rows.size and np.array_equal(unique_rows, rows):
            return data
        return data[inverse.reshape(-1)]

    def to_numpy(self) -> np.ndarray:
        return self.take(np.arange(self.n_samples))

    def _read_sorted(self, rows: np.ndarray) -> np.ndarray:
        if rows.size == 0:
            return np.empty((0, *self.shape[1:]), dtype=self.dtype)
        self._counter.rows += int(rows.size)
        first, last = int(rows[0]), int(rows[-1])
        if last - first + 1 == rows.size:
            rows_slice = self._source[first : last + 1]
            # A numpy slice is a view; copy so callers can never write into the source.
            return np.array(rows_slice) if isinstance(self._source, np.ndarray) else np.asarray(rows_slice)
        window = self._window(first, last)
        if window is not None:
            self._counter.rows -= int(rows.size)  # counted when the window was read
            start, data = window
            return data[rows - start]
        if hasattr(self._source, "oindex"):  # zarr: plain [] does not take integer arrays everywhere
            return np.asarray(self._source.oindex[rows])
        return np.asarray(self._source[rows])

    def _window(self, first: int, last: int) -> tuple[int, np.ndarray] | None:
        """For a chunked file (zarr, HDF5 through h5py): the aligned window of `block_size` source rows
        holding rows first..last, read whole once and kept, or None when they span two windows.

        Scattered rows of a chunked array cost a decode of every chunk they touch; under `--shuffle
        block` the batches of one block all fall in one window, so the block is decoded once rather
        than once per batch. Arrays and memory maps are read row by row as asked."""
        if isinstance(self._source, np.ndarray):
            return None
        size = self._block_size
        start = first // size * size
        if last >= start + size:
            return None
        cached = self._counter.window
        if cached is None or cached[0] != start:
            stop = min(start + size, int(self._source.shape[0]))
            cached = self._counter.window = (start, np.asarray(self._source[start:stop]))
            self._counter.rows += stop - start
        return cached

    # -------------------------------------------------------------- transformations

    def _logical_rows(self) -> np.ndarray:
        return np.arange(self.n_samples) if self._index is None else self._index

    def shuffle(self, seed: int) -> DSTensor:
        """Global shuffle: a true random permutation of all samples across blocks.

        The permutation is ``np.random.default_rng(seed).permutation(n_samples)``, so it depends
        only on ``seed`` and ``n_samples``: shuffling ``x`` and ``y`` of equal length with the
        same seed keeps every (x, y) pair aligned. Block lengths are unchanged.
        """
        perm = np.random.default_rng(seed).permutation(self.n_samples)
        return self._derive(self._logical_rows()[perm], self._lengths)

    def local_shuffle(self, seed: int) -> DSTensor:
        """Permute samples within each block only; which samples a block holds is unchanged.

        Reproducible from ``seed`` and the block lengths (so ``x`` and ``y`` with equal
        block lengths stay aligned under the same seed).
        """
        keys = np.random.default_rng(seed).random(self.n_samples)
        block_of_sample = np.repeat(np.arange(self.n_blocks), self._lengths)
        order = np.lexsort((keys, block_of_sample))
        return self._derive(self._logical_rows()[order], self._lengths)

    def block_shuffle(self, seed: int) -> DSTensor:
        """A random order of the blocks and a random order inside each: every sample once, and
        consecutive samples come from one block (a contiguous range of the source), so a file
        is read block by block rather than row by row. Reproducible from ``seed`` and the block lengths."""
        rng = np.random.default_rng(seed)
        order = rng.permutation(self.n_blocks)
        rows = [self._offsets[b] + rng.permutation(self._lengths[b]) for b in order]
        picked = np.concatenate(rows) if rows else np.arange(0)
        return self._derive(self._logical_rows()[picked], tuple(self._lengths[b] for b in order))

    def rechunk(self, block_size: int) -> DSTensor:
        """Same samples in the same order, cut into blocks of ``block_size``."""
        size = _check_block_size(block_size)
        return self._derive(self._index, _even_blocks(self.n_samples, size), size)

    def slice(self, start: int, stop: int) -> DSTensor:
        """Logical samples ``[start, stop)``; block boundaries are the intersections with this tensor's blocks."""
        if not 0 <= start <= stop <= self.n_samples:
            raise IndexError(f"slice [{start}, {stop}) out of range for {self.n_samples} samples")
        starts = np.clip(self._offsets[:-1], start, stop)
        stops = np.clip(self._offsets[1:], start, stop)
        lengths = tuple(int(n) for n in stops - starts if n > 0)
        rows = np.arange(start, stop) if self._index is None else self._index[start:stop]
        return self._derive(rows, lengths)

    def subset(self, indices: Any) -> DSTensor:
        """The samples at logical ``indices``, in that order, cut into blocks of the nominal block size.

        For partitions that are not contiguous (a held-out split, label-skewed clients);
        pass sorted indices to keep reads close to source order.
        """
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= self.n_samples):
            raise IndexError(f"indices must lie in [0, {self.n_samples})")
        return self._derive(self._logical_rows()[indices], _even_blocks(indices.size, self._block_size))

    # ------------------------------------------------------------------ distribution

    def shard(self, rank: int, world: int) -> DSTensor:
        """Logical samples ``[rank*n//world, (rank+1)*n//world)``; shard sizes differ by at most one."""
        _check_rank(rank, world)
        n = self.n_samples
        return self.slice(rank * n // world, (rank + 1) * n // world)

    # -------------------------------------------------------------------- pickling

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        in_memory = isinstance(self._source, np.ndarray) and not isinstance(self._source, np.memmap)
        if self._origin is not None and not in_memory:
            state["_source"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._source is None:
            path, key = self._origin
            self._source = _open_source(Path(path), key)


def _check_block_size(block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise UserError(f"block_size {block_size!r} is invalid; use a positive integer.")
    return int(block_size)


def _check_rank(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} and world {world} must satisfy 0 <= rank < world")


def _even_blocks(n: int, block_size: int) -> tuple[int, ...]:
    full, rest = divmod(n, block_size)
    return (block_size,) * full + ((rest,) if rest else ())


# ---------------------------------------------------------------------- file sources


def _file_suffix(path: Path) -> str:
    """The format of ``path`` (``.zarr`` also for ``*.zarr.zip``), checked to exist and be supported."""
    suffix = ".zarr" if path.name.lower().endswith(".zarr.zip") else path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise UserError(f"data file '{path}' has an unsupported extension; use one of: {', '.join(FILE_SUFFIXES)}.")
    if not path.exists():
        raise UserError(f"data file '{path}' does not exist.")
    return suffix


def list_arrays(path: str | Path) -> list[str]:
    """Names of the arrays at the root of an ``.npz``, HDF5 file or zarr group ([] for a single array)."""
    path = Path(path)
    suffix = _file_suffix(path)
    if suffix == ".npz":
        with _npz(path) as archive:
            return list(archive.files)
    if suffix in (".h5", ".hdf5"):
        import h5py

        with _hdf5(path) as handle:
            return [name for name, item in handle.items() if isinstance(item, h5py.Dataset)]
    if suffix == ".zarr":
        node = _zarr(path)
        return sorted(node.array_keys()) if hasattr(node, "array_keys") else []
    return []


def _open_source(path: Path, key: str | None) -> Any:
    """The array-like behind ``path`` (and ``key``), opened read-only without loading it."""
    suffix = _file_suffix(path)
    if suffix == ".npy":
        if key is not None:
            raise UserError(f"data file '{path}' holds a single array, so key '{key}' does not apply; leave it unset.")
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise UserError(f"data file '{path}' is not a readable .npy array ({exc}).") from None
    if suffix == ".npz":
        with _npz(path) as archive:
            if key in archive.files:
                return archive[key]
    elif suffix in (".h5", ".hdf5"):
        import h5py

        handle = _hdf5(path)
        item = handle.get(key) if key is not None else None
        if isinstance(item, h5py.Dataset):
            mapped = _hdf5_memmap(path, item)
            if mapped is None:
                return item  # keeps the file open for lazy reads
            handle.close()
            return mapped
        handle.close()
    else:
        node = _zarr(path)
        if not hasattr(node, "array_keys"):
            if key is not None:
                raise UserError(f"data file '{path}' holds a single zarr array, so key '{key}' does not apply; leave it unset.")
            return node
        if key in set(node.array_keys()):
            return node[key]
    held = ", ".join(list_arrays(path)) or "no arrays"
    if key is None:
        raise UserError(f"data file '{path}' needs a key naming the array to read; it holds: {held}.")
    raise UserError(f"data file '{path}' has no array '{key}'; it holds: {held}.")


def _hdf5_memmap(path: Path, dataset: Any) -> np.memmap | None:
    """A written, contiguous HDF5 dataset of numbers (h5py's default layout: no chunks, so no filters) as a
    read-only memmap of its bytes in the file, or None for any other layout or type.

    The bytes are the same; numpy gathers a batch of scattered rows from the mapping several times faster
    than HDF5 reads the same selection (benchmarks/README.md, section 9).
    """
    import h5py

    offset = dataset.id.get_offset()  # None unless contiguous (not chunked, compact, external, virtual)
    dtype = dataset.dtype
    if offset is None or dataset.ndim == 0 or dataset.size == 0 or dtype.kind not in "iuf":
        return None
    # Written (an unwritten one reads as its fill value, and its offset is meaningless) and stored exactly as
    # `dtype`, so the mapped bytes are what h5py would return.
    if dataset.id.get_storage_size() != dataset.size * dtype.itemsize or \
            dataset.id.get_type() != h5py.h5t.py_create(dtype):
        return None
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=dataset.shape)


def _npz(path: Path) -> Any:
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise UserError(f"data file '{path}' is not a readable .npz archive ({exc}).") from None


def _hdf5(path: Path) -> Any:
    import h5py

    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise UserError(f"data file '{path}' is not a readable HDF5 file ({exc}).") from None


def _zarr(path: Path) -> Any:
    """The zarr group or array in a directory store or a zip file."""
    import zarr

    try:
        store = zarr.storage.ZipStore(str(path), mode="r") if path.is_file() else str(path)
        return zarr.open(store=store, mode="r")
    except Exception as exc:  # zarr raises many unrelated types for an unreadable store
        raise UserError(f"data file '{path}' is not a readable zarr store ({exc}).") from None
