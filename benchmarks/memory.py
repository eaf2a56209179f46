"""Peak memory per worker against data-set size: does streaming keep it flat?

    python benchmarks/memory.py benchmarks/results/memory.json 2500 20000
    python benchmarks/memory.py benchmarks/results/memory_scaling.json 1250 5000 20000 --formats npy,h5,zarr

For each format and size N, writes N x 3 x 64 x 64 float32 samples (48 KiB each) and int64
labels into a temporary directory: x.npy/y.npy in a directory (npy), x/y in an .h5 (h5py's
contiguous layout) or in a .zarr group (x in chunks of --chunk samples); with --test-samples K
also x_test/y_test of K samples (otherwise dptrain holds 20% of x out for testing, so the test
set grows with N). Trains 1 epoch of the mlp on it with 2 local workers (`--data PATH`, batch
64, --shuffle as given) and polls every worker's /proc status: VmHWM (peak resident, which
counts the file pages a memmap has touched and the kernel may drop at any time) and the peak of
RssAnon (memory the process itself holds: arrays, tensors, the model). The goal: the peak
anonymous memory does not grow with the data. Writes OUT (one row per run) and a plot of both
peaks against the size beside it (.png).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SHAPE = (3, 64, 64)


def _status(pid: int) -> dict[str, int]:
    values = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "RssAnon"):
                values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def write_data(fmt: str, size: int, work: Path, chunk: int, test: int) -> Path:
    """`size` samples (and `test` test samples) in `fmt`, written 1,024 at a time; the path to give --data."""
    rng = np.random.default_rng(0)
    parts = {"": size, "_test": test} if test else {"": size}
    if fmt == "npy":
        path = work / f"data-{size}"
        path.mkdir()
        handle = None
    elif fmt == "h5":
        import h5py

        path = work / f"data-{size}.h5"
        handle = h5py.File(path, "w")
    else:
        import zarr

        path = work / f"data-{size}.zarr"
        handle = zarr.open_group(str(path), mode="w")
    for suffix, n in parts.items():
        y = rng.integers(0, 10, n)
        if fmt == "npy":
            x = np.lib.format.open_memmap(path / f"x{suffix}.npy", mode="w+", dtype=np.float32, shape=(n, *SHAPE))
            np.save(path / f"y{suffix}.npy", y)
        elif fmt == "h5":
            x = handle.create_dataset(f"x{suffix}", shape=(n, *SHAPE), dtype=np.float32)
            handle.create_dataset(f"y{suffix}", data=y)
        else:
            x = handle.create_array(f"x{suffix}", shape=(n, *SHAPE), dtype=np.float32, chunks=(chunk, *SHAPE))
            handle.create_array(f"y{suffix}", shape=(n,), dtype=np.int64)[:] = y  # zarr's default chunks
        step = chunk * max(1, 1024 // chunk)
        for start in range(0, n, step):
            x[start:start + step] = rng.standard_normal((min(step, n - start), *SHAPE), dtype=np.float32)
        if fmt == "npy":
            x.flush()
            del x
    if fmt == "h5":
        handle.close()
    return path


def measure(fmt: str, size: int, work: Path, chunk: int, shuffle: str, test: int) -> dict:
    data = write_data(fmt, size, work, chunk, test)
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dptrain", "train", "--data", str(data), "--model", "mlp",
                             "--workers", "2", "--epochs", "1", "--batch-size", "64", "--no-progress",
                             "--shuffle", shuffle, "--checkpoint-every", "0", "--out", str(work / f"run-{fmt}-{size}")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, dict[str, int]] = {}

    def poll() -> None:
        while proc.poll() is None:
            for pid in _children(proc.pid):
                now = _status(pid)
                seen = peaks.setdefault(pid, {"VmHWM": 0, "RssAnon": 0})
                for key, value in now.items():
                    seen[key] = max(seen[key], value)
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, stderr = proc.communicate()
    poller.join()
    if proc.returncode != 0:
        raise SystemExit(stderr)
    subprocess.run(["rm", "-rf", str(data)], check=True)
    workers = list(peaks.values())
    return {"format": fmt, "shuffle": shuffle, "samples": size, "bytes": size * int(np.prod(SHAPE)) * 4,
            "test_set": f"x_test of {test} samples" if test else "20% of x held out",
            "seconds": round(time.perf_counter() - began, 1),
            "peak_resident_bytes": max(w["VmHWM"] for w in workers),
            "peak_anonymous_bytes": max(w["RssAnon"] for w in workers)}


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k, fmt in enumerate(dict.fromkeys(row["format"] for row in rows)):
        mine = [row for row in rows if row["format"] == fmt]
        data = [row["bytes"] / 1e9 for row in mine]
        ax.plot(data, [row["peak_anonymous_bytes"] / 1e6 for row in mine], "o-", color=f"C{k}",
                label=f"{fmt}: peak anonymous (RssAnon)")
        ax.plot(data, [row["peak_resident_bytes"] / 1e6 for row in mine], "s--", color=f"C{k}", alpha=0.6,
                label=f"{fmt}: peak resident (VmHWM)")
    sizes = sorted({row["bytes"] for row in rows})
    ax.plot([b / 1e9 for b in sizes], [b / 1e6 for b in sizes], ":", color="grey", label="the data set itself")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([b / 1e9 for b in sizes], [f"{b / 1e9:.2f} GB\n({b / sizes[0]:.0f}x)" for b in sizes])
    ax.minorticks_off()
    ax.set_xlabel("data set size (GB)")
    ax.set_ylabel("peak per worker (MB), largest of 2 workers")
    ax.set_title(f"1 epoch of the mlp, 2 workers, batch 64, --shuffle {rows[0]['shuffle']}, {rows[0]['test_set']}",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("sizes", type=int, nargs="*", help="samples per data set, smallest first")
    parser.add_argument("--formats", default="npy", help="comma-separated: npy, h5, zarr")
    parser.add_argument("--chunk", type=int, default=64, help="samples per zarr chunk")
    parser.add_argument("--shuffle", default="global")
    parser.add_argument("--test-samples", type=int, default=0,
                        help="write x_test/y_test of this many samples (default: none, 20%% of the data are held out)")
    parser.add_argument("--replot", action="store_true", help="only draw the PNG again from OUT")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        for fmt in args.formats.split(","):
            for size in args.sizes:
                rows.append(measure(fmt, size, Path(tmp), args.chunk, args.shuffle, args.test_samples))
                print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        first = next(r for r in rows if r["format"] == row["format"])
        row["data_ratio"] = row["bytes"] / first["bytes"]
        row["anonymous_ratio"] = row["peak_anonymous_bytes"] / first["peak_anonymous_bytes"]
        row["resident_ratio"] = row["peak_resident_bytes"] / first["peak_resident_bytes"]
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    for row in rows:
        print(f"{row['format']:4s} {row['bytes'] / 1e9:6.2f} GB data: peak anonymous "
              f"{row['peak_anonymous_bytes'] / 1e6:7.0f} MB ({row['anonymous_ratio']:.2f}x), peak resident "
              f"{row['peak_resident_bytes'] / 1e6:7.0f} MB ({row['resident_ratio']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
