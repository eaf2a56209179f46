"""Sharded data: dptrain's stream reader against a plain DataLoader over the same webdataset and Parquet pipelines,
its peak memory as the data grows 8x, and the time to plan a run over 1,000 shards.

    python benchmarks/stream_throughput.py benchmarks/results/stream_throughput.json

Writes N samples of 3 x 16 x 16 float32 (.npy) and a .cls label as 32 WebDataset tar shards, and the same rows
(768 floats and y) as 32 Parquet files, then in a fresh process each, one torch thread, --loader-workers 0:

- plain webdataset: `DataLoader(wds.WebDataset(urls).decode().to_tuple("npy", "cls").batched(B), batch_size=None)`
- plain parquet: a torch IterableDataset yielding the rows of each file by pyarrow's `iter_batches`, batched by
  `DataLoader(batch_size=B)`
- dptrain: what `Trainer.fit` reads for the same `--data` (open_shards, one rank, StreamReader, --shuffle
  global: shards in a drawn order through the 1,024-sample shuffle buffer).

Each reads one epoch untimed (imports, page cache), then whole epochs for --seconds, counting samples; the ratio is dptrain's median over plain's (goal >= 0.97).
--loader-workers L reads with L DataLoader worker processes instead (the plain readers split the shards by worker:
webdataset's own split_by_worker, the Parquet files in turn), and --throughput-only skips memory and start.
--unshared adds dptrain's readers as they were before a worker's batch was stacked into shared memory (numpy's
stack, then a tensor of it, which DataLoader copies to shared memory to send it), interleaved with the others,
and the milliseconds a worker takes to make a batch ready to send both ways (`collate_cost`).
Memory: the peak RSS of dptrain reading N and 8N samples (goal <= 1.25x), and its growth above the RSS
before reading. Start: the seconds from
`open_shards` to the first batch over 1,000 tar shards of 8 samples each (the index of every shard is read).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BATCH = 64


def write(folder: Path, samples: int, shards: int, parquet: bool = True) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds

    rng = np.random.default_rng(0)
    (folder / "tar").mkdir(parents=True)
    (folder / "parquet").mkdir()
    per = samples // shards
    for shard in range(shards):
        x = rng.normal(size=(per, 3, 16, 16)).astype(np.float32)
        y = rng.integers(0, 10, size=per)
        with wds.TarWriter(str(folder / "tar" / f"train-{shard:06d}.tar")) as writer:
            for i in range(per):
                writer.write({"__key__": f"{shard:06d}{i:06d}", "npy": x[i], "cls": int(y[i])})
        if parquet:
            table = pa.table({"x": list(x.reshape(per, -1)), "y": y})
            pq.write_table(table, folder / "parquet" / f"part-{shard:06d}.parquet")


def reader(kind: str, folder: Path, workers: int = 0):
    import torch
    import webdataset as wds

    torch.set_num_threads(1)
    urls = sorted(str(p) for p in (folder / "tar").glob("*.tar"))
    if kind == "plain-webdataset":
        pipeline = wds.WebDataset(urls, shardshuffle=False).decode().to_tuple("npy", "cls").batched(BATCH)
        return torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=workers)
    if kind == "plain-parquet":
        import pyarrow.parquet as pq

        class Rows(torch.utils.data.IterableDataset):
            def __iter__(self):
                info = torch.utils.data.get_worker_info()
                paths = sorted((folder / "parquet").glob("*.parquet"))
                for path in paths[info.id::info.num_workers] if info is not None else paths:
                    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["x", "y"]):
                        for x, y in zip(batch.column("x").to_numpy(zero_copy_only=False),
                                        batch.column("y").to_numpy(zero_copy_only=False)):
                            yield np.array(x, dtype=np.float32), y
        return torch.utils.data.DataLoader(Rows(), batch_size=BATCH, num_workers=workers)
    from dptrain.data import streams
    from dptrain.data.shard_files import open_shards
    from dptrain.data.streams import StreamReader

    if kind.startswith("unshared"):  # the collation before it stacked a worker's batch into shared memory
        from dptrain.data.sampler import to_tensor

        streams._stacked = lambda values: to_tensor(
            np.stack(values) if isinstance(values[0], np.ndarray) else np.asarray(values))
    data = str(folder / ("tar/train-*.tar" if kind.endswith("webdataset") else "parquet"))
    stream = open_shards(data)
    stream.plan(0, 1, workers, BATCH, seed=0, shuffle="global")
    return StreamReader(stream, workers)


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def measure(kind: str, folder: Path, seconds: float, workers: int = 0) -> dict:
    loader = reader(kind, folder, workers)
    before = _rss_mb()
    for _ in loader:  # one epoch not timed: the first decode imports and warms what it uses
        pass
    samples, start, epochs = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds or epochs == 0:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epochs)
        for x, _ in loader:
            samples += len(x)
        epochs += 1
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"samples_per_second": samples / elapsed, "epochs": epochs, "rss_before_reading_mb": before,
            "peak_rss_mb": peak}


def start_time(folder: Path) -> dict:
    from dptrain.data.shard_files import open_shards
    from dptrain.data.streams import StreamReader

    began = time.perf_counter()
    stream = open_shards(str(folder / "tar/train-*.tar"))
    stream.plan(0, 4, 0, 8, seed=0, shuffle="global")
    next(iter(StreamReader(stream, 0)))
    return {"shards": len(stream.shards), "seconds_to_first_batch": time.perf_counter() - began}


def child(args: list[str], options: list[str] = ()) -> dict:
    out = subprocess.run([sys.executable, __file__, *options, "--child", *args], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.splitlines()[-1])


def collate_cost(side: int, repeats: int = 30) -> dict:
    """Milliseconds (the least of `repeats`) for a loader worker to make one batch of BATCH samples of
    3 x side x side float32 ready to send: stacked into shared memory (dptrain now), or stacked by numpy and then
    moved to shared memory as DataLoader's queue does with a tensor that is not there (before)."""
    import torch
    from torch.utils.data import _utils

    from dptrain.data import streams
    from dptrain.data.sampler import to_tensor

    torch.set_num_threads(1)
    xs = tuple(np.random.default_rng(0).normal(size=(BATCH, 3, side, side)).astype(np.float32))
    ways = {"shared": lambda: streams._stacked(xs), "unshared": lambda: to_tensor(np.stack(xs)).share_memory_()}
    real, best = streams.get_worker_info, {}
    streams.get_worker_info = lambda: _utils.worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None)
    try:
        for _ in range(repeats):
            for way, make in ways.items():
                began = time.perf_counter()
                batch = make()
                best[way] = min(best.get(way, float("inf")), (time.perf_counter() - began) * 1e3)
                assert batch.is_shared()
                del batch
    finally:
        streams.get_worker_info = real
    return {"sample_shape": [3, side, side], "batch_mb": BATCH * 3 * side * side * 4 / 2**20,
            **{f"{way}_ms": round(ms, 3) for way, ms in best.items()}}


def memory_and_start(results: dict, small: Path, large: Path, many: Path, samples: int) -> None:
    write(large, samples * 8, 256, parquet=False)
    memory = [child(["dptrain-webdataset", str(folder), "0"]) for folder in (small, large)]
    results["peak_rss_mb"] = {"N": memory[0]["peak_rss_mb"], "8N": memory[1]["peak_rss_mb"],
                              "ratio": memory[1]["peak_rss_mb"] / memory[0]["peak_rss_mb"],
                              "above_start_N": memory[0]["peak_rss_mb"] - memory[0]["rss_before_reading_mb"],
                              "above_start_8N": memory[1]["peak_rss_mb"] - memory[1]["rss_before_reading_mb"]}
    write(many, 8000, 1000, parquet=False)
    results["start_1000_shards"] = child(["start", str(many)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?")
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loader-workers", type=int, default=0)
    parser.add_argument("--throughput-only", action="store_true")
    parser.add_argument("--unshared", action="store_true")
    parser.add_argument("--child", nargs="+")
    options = parser.parse_args()
    if options.child:
        what, folder = options.child[0], Path(options.child[1])
        if what == "collate":
            result = collate_cost(int(options.child[2]))
        else:
            result = start_time(folder) if what == "start" else measure(what, folder, float(options.child[2]),
                                                                        options.loader_workers)
        print(json.dumps(result))
        return
    results: dict = {"samples": options.samples, "batch": BATCH, "loader_workers": options.loader_workers, "runs": {}}
    workers = ["--loader-workers", str(options.loader_workers)]
    with tempfile.TemporaryDirectory() as tmp:
        small, large, many = Path(tmp) / "small", Path(tmp) / "large", Path(tmp) / "many"
        write(small, options.samples, 32)
        kinds = [f"{reader}-{fmt}" for fmt in ("webdataset", "parquet")
                 for reader in ("plain", "dptrain", *(["unshared"] if options.unshared else []))]
        for _ in range(options.repeats):
            for kind in kinds:
                results["runs"].setdefault(kind, []).append(child([kind, str(small), str(options.seconds)], workers))
        for fmt in ("webdataset", "parquet"):
            speed = {kind: statistics.median(r["samples_per_second"] for r in results["runs"][f"{kind}-{fmt}"])
                     for kind in ("plain", "dptrain")}
            results[f"{fmt}_ratio"] = speed["dptrain"] / speed["plain"]
            if options.unshared:
                results[f"{fmt}_unshared_ratio"] = statistics.median(
                    r["samples_per_second"] for r in results["runs"][f"unshared-{fmt}"]) / speed["plain"]
        if not options.throughput_only:
            memory_and_start(results, small, large, many, options.samples)
        if options.unshared:
            results["collate_cost"] = [child(["collate", "", str(side)]) for side in (16, 64, 224)]
    text = json.dumps(results, indent=2)
    print(text)
    if options.out:
        Path(options.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
