"""Shards for the stream tests, written by the libraries that read them (webdataset's TarWriter, pyarrow), and a
model that records which samples it trained on.

Sample i holds x = [i, sin i, cos i, i mod 3] and y = i mod 3, so its id travels with it; `Recording` (a
`--model stream_data.py:recording`) appends each training batch's ids, one line a batch, to
$STREAM_RECORD/rank{RANK}.txt (and takes $STREAM_STEP_SECONDS longer a batch: epochs long enough for a joiner)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

SIZES = (5, 17, 9, 12, 3, 20, 14)  # uneven on purpose: 80 samples in 7 shards


def features(i: int) -> np.ndarray:
    return np.array([i, np.sin(i), np.cos(i), i % 3], dtype=np.float32)


def offsets(sizes=SIZES) -> list[int]:
    return [sum(sizes[:k]) for k in range(len(sizes))]


def write_tars(folder: Path, sizes=SIZES) -> str:
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    for shard, (first, size) in enumerate(zip(offsets(sizes), sizes)):
        with wds.TarWriter(str(folder / f"train-{shard:06d}.tar")) as writer:
            for i in range(first, first + size):
                writer.write({"__key__": f"{i:08d}", "npy": features(i), "cls": i % 3})
    return f"{folder.name}/train-{{000000..{len(sizes) - 1:06d}}}.tar"


def write_parquets(folder: Path, sizes=SIZES) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for shard, (first, size) in enumerate(zip(offsets(sizes), sizes)):
        ids = range(first, first + size)
        table = pa.table({"x": [features(i).tolist() for i in ids], "y": [i % 3 for i in ids]})
        pq.write_table(table, folder / f"part-{shard:03d}.parquet")
    return folder.name


class Recording(nn.Module):
    def __init__(self, features: int, outputs: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, outputs)
        self.file = Path(os.environ["STREAM_RECORD"]) / f"rank{os.environ.get('RANK', '0')}.txt"
        self.seconds = float(os.environ.get("STREAM_STEP_SECONDS", "0"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(self.seconds)
            with open(self.file, "a") as handle:
                handle.write(" ".join(str(int(i)) for i in x[:, 0].tolist()) + "\n")
        return self.linear(x / 80.0)


def recording(input_shape, num_outputs):
    return Recording(int(np.prod(input_shape)), num_outputs)


def read_record(folder: Path, ranks: int) -> list[list[list[int]]]:
    """Each rank's batches, in order: ids per batch."""
    return [[[int(i) for i in line.split()] for line in (folder / f"rank{rank}.txt").read_text().splitlines()]
            for rank in range(ranks)]


class Counting(torch.utils.data.IterableDataset):
    """A plain torch IterableDataset of the same 80 samples (a data factory's return)."""

    def __init__(self, n: int = sum(SIZES)) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.from_numpy(features(i)), i % 3


def iterable():
    return Counting()


def hugging_face():
    import datasets

    ids = range(sum(SIZES))
    return datasets.Dataset.from_dict({"x": [features(i).tolist() for i in ids], "y": [i % 3 for i in ids]})


def hugging_face_iterable():
    return hugging_face().to_iterable_dataset(num_shards=4)


def hugging_face_other_columns():
    import datasets

    return datasets.Dataset.from_dict({"pixels": [[0.0, 1.0]] * 4, "target": [0, 1, 0, 1]})


class Silent(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


def empty():
    return Silent()


class SilentOnRank1(Counting):
    def __iter__(self):
        if os.environ.get("RANK") == "1":
            return iter(())
        return super().__iter__()


def empty_on_rank1():
    return SilentOnRank1()


class ShorterOnRank1(Counting):
    def __init__(self) -> None:
        super().__init__(sum(SIZES) - (10 if os.environ.get("RANK") == "1" else 0))


def shorter_on_rank1():
    return ShorterOnRank1()


def webdataset_pipeline():
    """A WebDataset pipeline of the shards in ./shards, with a shuffle and splitters of its own (dptrain drops
    them: it splits and shuffles by its rule)."""
    import glob

    import webdataset as wds

    urls = sorted(glob.glob("shards/train-*.tar"))
    return (wds.WebDataset(urls, shardshuffle=True, nodesplitter=wds.split_by_node, seed=1).shuffle(50)
            .decode().to_tuple("npy", "cls"))
