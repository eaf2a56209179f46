"""Sharded data on disk and in the libraries made for it, as ShardedStreams (dptrain.data.streams).

- a tar shard pattern (`'shards/train-{000000..000099}.tar'`, a glob, or one .tar): WebDataset shards,
  each sample's x its `.npy` (or `.png`/`.jpg`/`.jpeg`, read as a float CHW image in [0, 1]) and y its
  `.cls` (an integer class label), read by the `webdataset` library; a shard's samples are counted from its
  tar index (the stdlib's tarfile), which also tells a truncated shard from a whole one.
- a directory of `.parquet` files (or a pattern of them): columns `x` (a list of numbers per row) and `y`,
  read by pyarrow; counted from each file's metadata.
- from a data factory: a WebDataset pipeline (its shard list is split by dptrain's rule, its other stages
  kept, its own shuffles and splitters dropped), a Hugging Face `datasets.Dataset` (map-style: the usual
  sampler) or `datasets.IterableDataset` (one shard per `n_shards`), or any torch IterableDataset of (x, y)
  pairs (one shard, counted by one pass).

A Hugging Face dataset's columns are taken from the first pair of COLUMN_PAIRS it has.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from dptrain.data.shard_patterns import shard_paths
from dptrain.data.streams import Shard, ShardedStream
from dptrain.errors import UserError

X_KEYS = ("npy", "png", "jpg", "jpeg")
COLUMN_PAIRS = (("x", "y"), ("image", "label"), ("input", "label"), ("features", "label"))
_DROPPED_STAGES = {"single_node_only", "split_by_node", "split_by_worker", "_shuffle", "detshuffle", "shuffle"}


def open_shards(data: str, base: Path = Path(), stage_to: Optional[str] = None,
                timeout: float = 300.0) -> ShardedStream:
    """The stream --data names, with every sample's label (from the tar index, or the Parquet column y); with
    `stage_to`, its shards copied there in the background as training begins, each read from there once its
    copy is complete (dptrain.data.staging)."""
    paths = shard_paths(data, base)
    staging, where = None, lambda path: path
    if stage_to is not None:
        from dptrain.data.staging import Staging
        staging = Staging(paths, stage_to, timeout)
        where = staging.where  # a resumed run counts its shards in the copies too
    if paths[0].endswith(".tar"):
        indexed = [tar_index(where(path)) for path in paths]
        stream = ShardedStream([Shard(path, count) for path, (count, _) in zip(paths, indexed)], read_tar, data,
                               _collate(), staging)
        stream.labels = np.asarray([label for _, labels in indexed for label in labels], dtype=np.int64)
        return stream
    stream = ShardedStream([Shard(path, parquet_rows(where(path), data)) for path in paths], read_parquet, data,
                           _collate(), staging)
    stream.labels = np.concatenate([parquet_labels(where(path)) for path in paths])
    return stream


def _collate():
    from dptrain.data.streams import collate_pairs
    return collate_pairs


# -- WebDataset tar shards ------------------------------------------------------------------------------------
def tar_index(path: str) -> tuple[int, list[int]]:
    """(samples, their .cls labels) of a tar shard, from its member headers (webdataset's rule: a sample is the
    run of members sharing the name before the first dot). A corrupt or truncated file: one line naming it
    and the sample where it breaks."""
    from webdataset.tariterators import base_plus_ext

    size, samples, labels, key = os.path.getsize(path), 0, [], None
    try:
        with tarfile.open(path, "r:") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                if member.offset_data + member.size > size:
                    raise tarfile.ReadError(f"member '{member.name}' runs past the end of the file")
                prefix, suffix = base_plus_ext(member.name)
                if prefix is None:
                    continue
                if prefix != key:
                    samples, key = samples + 1, prefix
                if suffix == "cls":
                    labels.append(int(archive.extractfile(member).read().decode().strip()))
    except (tarfile.TarError, EOFError, OSError, ValueError) as error:
        raise UserError(f"shard '{path}' is not a readable tar file (corrupt or truncated at sample {samples}): "
                        f"{error}; rebuild it, or remove it from --data") from None
    if labels and len(labels) != samples:
        raise UserError(f"shard '{path}' has {samples} samples but {len(labels)} .cls labels; every sample needs one")
    return samples, labels


def _keep_all(source):
    return source


def read_tar(shard: Shard) -> Iterable:
    """A tar shard's (x, y) samples in order, read by webdataset."""
    import webdataset as wds

    pipeline = wds.WebDataset([shard.name], shardshuffle=False, nodesplitter=_keep_all, workersplitter=_keep_all,
                              empty_check=False).decode("torchrgb").to_tuple(";".join(X_KEYS), "cls")
    return _named_errors(pipeline, shard.name)


def _named_errors(samples: Iterable, name: str) -> Iterable:
    index = 0
    try:
        for index, sample in enumerate(samples):
            yield sample
    except (OSError, ValueError, KeyError, tarfile.TarError) as error:
        raise UserError(f"shard '{name}' could not be read at sample {index}: {type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else ''}") from None


# -- Parquet ------------------------------------------------------------------------------------------------
def _parquet(path: str):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as error:  # noqa: BLE001 - pyarrow's errors for a bad file are of several types
        raise UserError(f"shard '{path}' is not a readable Parquet file (corrupt or truncated): "
                        f"{str(error).splitlines()[0]}; rebuild it, or remove it from --data") from None


def parquet_rows(path: str, data: str) -> int:
    parquet = _parquet(path)
    names = parquet.schema_arrow.names
    if not {"x", "y"} <= set(names):
        raise UserError(f"--data '{data}': Parquet file '{path}' has the columns {', '.join(names)}; it needs "
                        "columns x (the input) and y (the label)")
    return parquet.metadata.num_rows


def parquet_labels(path: str) -> np.ndarray:
    values = _parquet(path).read(columns=["y"]).column("y").to_numpy()
    return values.astype(np.int64) if values.dtype.kind in "iu" else values


def read_parquet(shard: Shard) -> Iterable:
    """A Parquet file's (x, y) rows in order, read by pyarrow a record batch at a time."""
    row = 0
    try:
        for batch in _parquet(shard.name).iter_batches(batch_size=1024, columns=["x", "y"]):
            xs = _rows(batch.column("x"))
            ys = batch.column("y").to_numpy(zero_copy_only=False)
            for x, y in zip(xs, ys):
                yield np.array(x, dtype=np.float32), y
                row += 1
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 - pyarrow's read errors
        raise UserError(f"shard '{shard.name}' could not be read at sample {row}: "
                        f"{str(error).splitlines()[0]}") from None


def _rows(column):
    """A record batch's x column: a 2-D float32 array when every row is a list of numbers of one length (one
    conversion a batch; its rows are copied out one by one, so that a sample held in the shuffle buffer holds
    only itself), else pyarrow's array of rows."""
    import pyarrow as pa

    kind = column.type
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) and \
            len(column) and not column.null_count and (pa.types.is_floating(kind.value_type) or
                                                       pa.types.is_integer(kind.value_type)):
        values = column.flatten()
        if len(values) and not values.null_count and len(values) % len(column) == 0:
            width = len(values) // len(column)
            if pa.types.is_fixed_size_list(kind) or (np.diff(column.offsets.to_numpy()) == width).all():
                return values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, width)
    return column.to_numpy(zero_copy_only=False)


# -- what a data factory returns -----------------------------------------------------------------------------
def is_hugging_face(value: Any) -> bool:
    return type(value).__module__.startswith("datasets.") and hasattr(value, "column_names")


def hf_columns(dataset: Any, spec: str) -> tuple[str, str]:
    """The (x, y) columns of a Hugging Face dataset: the first of COLUMN_PAIRS it has."""
    names = list(dataset.column_names or [])
    for pair in COLUMN_PAIRS:
        if set(pair) <= set(names):
            return pair
    pairs = ", ".join(f"{x} and {y}" for x, y in COLUMN_PAIRS)
    raise UserError(f"--data {spec}: the Hugging Face dataset has the columns {', '.join(names) or '(none)'}; "
                    f"dptrain reads an input and a label column: {pairs} (rename yours with .rename_columns)")


class HuggingFacePairs(Dataset):
    """A map-style Hugging Face `datasets.Dataset` as (x, y) items of two of its columns."""

    def __init__(self, dataset: Any, spec: str) -> None:
        self.x, self.y = hf_columns(dataset, spec)
        self.dataset = dataset.with_format("numpy", columns=[self.x, self.y])
        self.targets = np.asarray(self.dataset[self.y])  # one Arrow column: the labels without reading x

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        row = self.dataset[int(index)]
        return row[self.x], row[self.y]


def stream_of(value: Any, spec: str) -> Optional[ShardedStream]:
    """A factory's iterable data as a ShardedStream (None: not iterable data)."""
    if _is_webdataset(value):
        return _webdataset_stream(value, spec)
    if is_hugging_face(value) and hasattr(value, "n_shards"):
        x, y = hf_columns(value, spec)
        shards = [value.shard(num_shards=value.n_shards, index=i) for i in range(value.n_shards)]
        return _counted([_Pairs(shard, x, y) for shard in shards], spec)
    if isinstance(value, IterableDataset):
        return _counted([value], spec)
    return None


class _Pairs:
    """A Hugging Face IterableDataset's rows as (x, y) of two columns."""

    def __init__(self, dataset: Any, x: str, y: str) -> None:
        self.dataset, self.x, self.y = dataset, x, y

    def __iter__(self):
        # .iter(): its plain iteration splits the shards over loader workers by itself, and dptrain splits
        for batch in self.dataset.iter(batch_size=256):
            for x, y in zip(batch[self.x], batch[self.y]):
                yield np.asarray(x), y


def _counted(parts: list, spec: str) -> ShardedStream:
    """Iterables counted by one pass each (nothing else tells their sizes): shard i reads parts[i]."""
    shards, labels = [], []
    for index, part in enumerate(parts):
        count = 0
        for count, sample in enumerate(part, start=1):
            if not isinstance(sample, (tuple, list)) or len(sample) != 2:
                raise UserError(f"--data {spec}: sample {count - 1} of the iterable dataset is "
                                f"{type(sample).__name__}; each must be an (x, y) pair")
            labels.append(np.asarray(sample[1]))
        shards.append(Shard(f"{spec} part {index}" if len(parts) > 1 else spec, count))
    if not sum(shard.samples for shard in shards):
        raise UserError(f"--data {spec}: the iterable dataset yielded no samples; it must yield (x, y) pairs")
    by_name = {shard.name: part for shard, part in zip(shards, parts)}
    stream = ShardedStream(shards, _PartReader(by_name), spec, _collate())
    stream.labels = np.asarray(labels) if all(label.ndim == 0 for label in labels) else None
    return stream


class _PartReader:
    def __init__(self, parts: dict) -> None:
        self.parts = parts

    def __call__(self, shard: Shard) -> Iterable:
        return iter(self.parts[shard.name])


def _is_webdataset(value: Any) -> bool:
    pipeline = getattr(value, "pipeline", None)
    return type(value).__module__.startswith("webdataset") and isinstance(pipeline, list) and pipeline \
        and hasattr(pipeline[0], "urls")


def _stage_name(stage: Any) -> str:
    return getattr(getattr(stage, "f", None), "__name__", None) or getattr(stage, "__name__", "")


def _webdataset_stream(pipeline: Any, spec: str) -> ShardedStream:
    """A WebDataset pipeline's shards, split by dptrain's rule; its stages after the shard list are kept except
    its splitters and shuffles (dptrain splits, and shuffles from the seed)."""
    urls = list(pipeline.pipeline[0].urls)
    stages = [stage for stage in pipeline.pipeline[1:] if _stage_name(stage) not in _DROPPED_STAGES]
    reader = _PipelineReader(stages)
    shards = []
    for url in urls:
        if os.path.isfile(url):
            count = tar_index(url)[0]
        else:  # not a local file: counted by reading it once
            count = sum(1 for _ in reader(Shard(url, 0)))
        shards.append(Shard(url, count))
    return ShardedStream(shards, reader, spec, _collate())


class _PipelineReader:
    def __init__(self, stages: list) -> None:
        self.stages = stages

    def __call__(self, shard: Shard) -> Iterable:
        import webdataset as wds

        return _named_errors(wds.DataPipeline(wds.SimpleShardList([shard.name]), *self.stages), shard.name)


def describe(stream: ShardedStream) -> str:
    sizes = [shard.samples for shard in stream.shards]
    return (f"dptrain: --data {stream.name}: {len(sizes)} shard{'s' if len(sizes) != 1 else ''}, {sum(sizes)} "
            f"samples ({min(sizes)} to {max(sizes)} a shard)")

