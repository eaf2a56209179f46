"""Samples/s of dptrain's read path against a plain DataLoader over the same npy, HDF5 and zarr files.

    python benchmarks/loader_throughput.py benchmarks/results/loader_throughput.json
    python benchmarks/loader_throughput.py benchmarks/results/loader_throughput_cold.json --cold

Writes the same generated data (N x 3 x 32 x 32 float32 and int64 labels) as a directory of
x.npy/y.npy, an .h5 (h5py's default contiguous layout) and a .zarr group (x in chunks of --chunk
samples, y in zarr's default chunks, zarr's default zstd codec), then reads batches from each in
turn, interleaved (every run once per repeat, in the same order), each in a fresh process with
one torch thread:

- plain: `DataLoader(dataset, batch_size, shuffle=True)` over a map-style Dataset that reads
  one x per item from the file (np.load mmap_mode='r', h5py indexing, zarr indexing); its
  labels are read into memory once (which favours it: dptrain reads them from the file);
- dptrain global / block / none: what `Trainer.fit` builds for (DSTensor x, DSTensor y) from
  the same files: `as_dataset`, `shard_plan` (one rank), `PlanBatches` and `loader`, with
  `--shuffle global`, `block` or `none` (file order, the ceiling of reading).

Each measurement iterates epochs until --seconds have passed and counts the samples of the
batches read (zarr read item by item does not finish an epoch in that time). The headline is
the median dptrain samples/s over the median plain samples/s per format (goal >= 0.9); the
median of the ratios within each repeat is kept too.
--cold drops the page cache (`/proc/sys/vm/drop_caches`, needs root) before each measurement
and times only the first --seconds (or first epoch) after it; without it the files are read
once beforehand, so every run reads from the page cache. A PNG of the bars is written beside OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FORMATS = ("npy", "h5", "zarr")
RUNS = ("plain", "dptrain global", "dptrain block", "dptrain none")
SHAPE = (3, 32, 32)


def write_data(root: Path, n: int, chunk: int) -> dict[str, Path]:
    """The same samples as x.npy/y.npy in a directory, x/y in an .h5 and x/y in a .zarr group."""
    import h5py
    import zarr

    rng = np.random.default_rng(0)
    paths = {"npy": root / "npy", "h5": root / "data.h5", "zarr": root / "data.zarr"}
    paths["npy"].mkdir()
    y = rng.integers(0, 10, n)
    np.save(paths["npy"] / "y.npy", y)
    x_npy = np.lib.format.open_memmap(paths["npy"] / "x.npy", mode="w+", dtype=np.float32, shape=(n, *SHAPE))
    with h5py.File(paths["h5"], "w") as h5:
        x_h5 = h5.create_dataset("x", shape=(n, *SHAPE), dtype=np.float32)
        h5.create_dataset("y", data=y)
        group = zarr.open_group(str(paths["zarr"]), mode="w")
        x_zarr = group.create_array("x", shape=(n, *SHAPE), dtype=np.float32, chunks=(chunk, *SHAPE))
        group.create_array("y", shape=(n,), dtype=np.int64)[:] = y  # zarr's default chunks
        step = chunk * max(1, 4096 // chunk)
        for start in range(0, n, step):
            part = rng.standard_normal((min(step, n - start), *SHAPE), dtype=np.float32)
            x_npy[start:start + len(part)] = part
            x_h5[start:start + len(part)] = part
            x_zarr[start:start + len(part)] = part
    x_npy.flush()
    return paths


def open_arrays(fmt: str, path: Path):
    """The raw (x, y) array-likes a user would open: read-only memmaps, h5py Datasets, zarr Arrays."""
    if fmt == "npy":
        return np.load(path / "x.npy", mmap_mode="r"), np.load(path / "y.npy", mmap_mode="r")
    if fmt == "h5":
        import h5py

        handle = h5py.File(path, "r")
        return handle["x"], handle["y"]
    import zarr

    group = zarr.open_group(str(path), mode="r")
    return group["x"], group["y"]


def plain_loader(fmt: str, path: Path, batch_size: int):
    """What a user writes: a map-style Dataset reading one item from the file, DataLoader(shuffle=True)."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    class FileItems(Dataset):
        def __init__(self) -> None:
            self.x, y = open_arrays(fmt, path)
            self.targets = np.asarray(y[:])

        def __len__(self) -> int:
            return len(self.targets)

        def __getitem__(self, i: int):
            item = self.x[i]  # a new array from h5py and zarr, a read-only view of the memmap
            return torch.from_numpy(item if item.flags.writeable else item.copy()), int(self.targets[i])

    dataset = FileItems()
    return DataLoader(dataset, batch_size=batch_size, shuffle=True), lambda epoch: None


def dptrain_loader(fmt: str, path: Path, batch_size: int, shuffle: str):
    """What Trainer.fit builds for (x, y) DSTensors of the file (one rank): the same objects, in the same way."""
    from dptrain.data.dstensor import DSTensor
    from dptrain.data.sampler import PlanBatches, as_dataset, loader, shard_plan

    if fmt == "npy":
        x, y = DSTensor.from_file(path / "x.npy"), DSTensor.from_file(path / "y.npy")
    else:
        x, y = DSTensor.from_file(path, "x"), DSTensor.from_file(path, "y")
    train = as_dataset((x, y))
    plan = shard_plan(len(train), 0, 1, batch_size, 0, shuffle, getattr(train, "block_size", None))
    batches = PlanBatches(plan)
    return loader(train, batches), batches.set_epoch


def measure(fmt: str, run: str, path: Path, batch_size: int, seconds: float, one_epoch: bool) -> dict:
    """Samples/s of reading batches for `seconds` (whole epochs while time is left, stopping at a batch)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    reader, set_epoch = (plain_loader(fmt, path, batch_size) if run == "plain"
                         else dptrain_loader(fmt, path, batch_size, run.split()[1]))
    started = time.perf_counter()  # after opening the files (and the plain Dataset reading its labels)
    samples, epoch, elapsed = 0, 0, 0.0
    while elapsed < seconds:
        set_epoch(epoch)
        for x, y in reader:
            samples += len(y)
            elapsed = time.perf_counter() - started
            if elapsed >= seconds:
                break
        else:
            epoch += 1
            if one_epoch:
                break
    assert x.dtype.is_floating_point and x.shape[1:] == SHAPE and not y.is_floating_point()
    return {"format": fmt, "run": run, "samples": samples, "seconds": elapsed, "epochs": epoch,
            "samples_per_second": samples / elapsed}


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def summarise(rows: list[dict]) -> dict:
    medians = {fmt: {run: statistics.median(r["samples_per_second"] for r in rows
                                            if r["format"] == fmt and r["run"] == run)
                     for run in RUNS} for fmt in FORMATS}
    ratios = {fmt: {run: medians[fmt][run] / medians[fmt]["plain"] for run in RUNS if run != "plain"}
              for fmt in FORMATS}
    rate = {(r["repeat"], r["format"], r["run"]): r["samples_per_second"] for r in rows}
    repeats = sorted({r["repeat"] for r in rows})
    paired = {fmt: {run: statistics.median(rate[k, fmt, run] / rate[k, fmt, "plain"] for k in repeats)
                    for run in RUNS if run != "plain"} for fmt in FORMATS}
    return {"median_samples_per_second": medians, "ratio_to_plain": ratios,
            "median_of_paired_ratios": paired}


def plot(summary: dict, rows: list[dict], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(RUNS)
    for k, run in enumerate(RUNS):
        xs = np.arange(len(FORMATS)) + (k - (len(RUNS) - 1) / 2) * width
        heights = [summary["median_samples_per_second"][fmt][run] for fmt in FORMATS]
        ax.bar(xs, heights, width, label=run)
        for i, fmt in enumerate(FORMATS):  # every repeat as a dot
            each = [r["samples_per_second"] for r in rows if r["format"] == fmt and r["run"] == run]
            ax.plot([xs[i]] * len(each), each, "k.", markersize=3)
            if run != "plain":
                ax.annotate(f"{summary['ratio_to_plain'][fmt][run]:.2f}x", (xs[i], max(each)), ha="center",
                            va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * 4)  # room for the legend
    ax.set_xticks(np.arange(len(FORMATS)), FORMATS)
    ax.set_ylabel("samples/s (bars: median; dots: each repeat)")
    ax.set_title(title + "\nlabels: median against the median of plain", fontsize=9)
    ax.legend(fontsize=8, ncol=len(RUNS), loc="upper center")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def title_of(settings: dict) -> str:
    return (f"{settings['samples']} samples of 3x32x32 float32, batch {settings['batch_size']}, one rank, "
            f"{'cold' if settings['cold'] else 'warm'} page cache, zarr chunks of {settings['chunk']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=32768)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64, help="samples per zarr chunk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each measurement")
    parser.add_argument("--replot", action="store_true", help="only draw the PNG again from OUT")
    parser.add_argument("--measure", nargs=3, metavar=("FORMAT", "RUN", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.out.read_text())
        plot(saved, saved["runs"], title_of(saved["settings"]), args.out.with_suffix(".png"))
        return 0
    if args.measure:
        fmt, run, path = args.measure
        print(json.dumps(measure(fmt, run, Path(path), args.batch_size, args.seconds, args.cold)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        began = time.time()
        paths = write_data(Path(tmp), args.samples, args.chunk)
        for repeat in range(args.repeats):
            for fmt in FORMATS:
                for run in RUNS:
                    if args.cold:
                        drop_caches()
                    else:  # into the page cache
                        subprocess.run(["cat", *[str(p) for p in Path(tmp).rglob("*") if p.is_file()]],
                                       stdout=subprocess.DEVNULL, check=True)
                    done = subprocess.run([sys.executable, __file__, str(args.out), "--batch-size",
                                           str(args.batch_size), "--seconds", str(args.seconds),
                                           *(["--cold"] if args.cold else []), "--measure", fmt, run,
                                           str(paths[fmt])], capture_output=True, text=True)
                    if done.returncode != 0:
                        raise SystemExit(done.stderr)
                    rows.append({"repeat": repeat, **json.loads(done.stdout)})
                    print(json.dumps(rows[-1]), flush=True)
    summary = summarise(rows)
    settings = {key: getattr(args, key) for key in ("samples", "batch_size", "chunk", "repeats", "seconds", "cold")}
    settings.update(sample_shape=SHAPE, bytes_per_format=args.samples * int(np.prod(SHAPE)) * 4,
                    minutes=round((time.time() - began) / 60, 1), load_average=os.getloadavg(),
                    when=time.strftime("%Y-%m-%d %H:%M"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": settings, **summary, "runs": rows}, indent=2) + "\n")
    plot(summary, rows, title_of(settings), args.out.with_suffix(".png"))
    for fmt in FORMATS:
        cells = "  ".join(f"{run} {summary['median_samples_per_second'][fmt][run]:9,.0f}/s"
                          + ("" if run == "plain" else f" ({summary['ratio_to_plain'][fmt][run]:.2f}x)")
                          for run in RUNS)
        print(f"{fmt:5s} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
