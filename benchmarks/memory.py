"""Peak memory per worker against data-set size: does streaming keep it flat?

    python benchmarks/memory.py benchmarks/results/memory.json 2500 20000

For each size N, writes x.npy (N x 3 x 64 x 64 float32, 48 KiB a sample) and y.npy into a
temporary directory, trains 1 epoch of the mlp on it with 2 local workers (`--data DIR`), and
polls every worker's /proc status: VmHWM (peak resident, which counts the file pages a memmap
has touched and the kernel may drop at any time) and the peak of RssAnon (memory the process
itself holds: arrays, tensors, the model). The goal: 8x the data costs at most 1.25x the peak
anonymous memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


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


def measure(size: int, work: Path) -> dict:
    data = work / f"data-{size}"
    data.mkdir()
    rng = np.random.default_rng(0)
    x = np.lib.format.open_memmap(data / "x.npy", mode="w+", dtype=np.float32, shape=(size, 3, 64, 64))
    for start in range(0, size, 1000):
        x[start:start + 1000] = rng.standard_normal((min(1000, size - start), 3, 64, 64), dtype=np.float32)
    x.flush()
    del x
    np.save(data / "y.npy", rng.integers(0, 10, size))
    proc = subprocess.Popen([sys.executable, "-m", "dptrain", "train", "--data", str(data), "--model", "mlp",
                             "--workers", "2", "--epochs", "1", "--batch-size", "64", "--no-progress",
                             "--checkpoint-every", "0", "--out", str(work / f"run-{size}")],
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
    workers = list(peaks.values())
    return {"samples": size, "bytes": size * 3 * 64 * 64 * 4,
            "peak_resident_bytes": max(w["VmHWM"] for w in workers),
            "peak_anonymous_bytes": max(w["RssAnon"] for w in workers)}


def main() -> int:
    out, sizes = Path(sys.argv[1]), [int(s) for s in sys.argv[2:]]
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        rows = []
        for size in sizes:
            rows.append(measure(size, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
            (Path(tmp) / f"data-{size}" / "x.npy").unlink()
    first = rows[0]
    for row in rows:
        row["data_ratio"] = row["bytes"] / first["bytes"]
        row["anonymous_ratio"] = row["peak_anonymous_bytes"] / first["peak_anonymous_bytes"]
        row["resident_ratio"] = row["peak_resident_bytes"] / first["peak_resident_bytes"]
    out.write_text(json.dumps(rows, indent=2) + "\n")
    for row in rows:
        print(f"{row['bytes'] / 1e9:6.2f} GB data: peak anonymous {row['peak_anonymous_bytes'] / 1e6:7.0f} MB "
              f"({row['anonymous_ratio']:.2f}x), peak resident {row['peak_resident_bytes'] / 1e6:7.0f} MB "
              f"({row['resident_ratio']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
