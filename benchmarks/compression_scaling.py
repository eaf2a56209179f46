"""Bytes and seconds of one compressed average against fp32's all-reduce, at W = 2, 4, 8 (gloo, 127.0.0.1).

    python benchmarks/compression_scaling.py benchmarks/results/compression-scaling   # writes .json and .md

On W processes joined by gloo on 127.0.0.1, each rank averages a vector of n float32 values
(a change drawn at random), `REPEATS` times after one warm-up, and the median of the slowest rank's
seconds is kept, for:

- fp32: the uncompressed path (one all_reduce of the 4n bytes, then the division: what
  average_module does for a flat float32 model);
- fp16 and int8, each with the former scheme (`all-gather`: every payload to every rank, every rank
  decodes W payloads) and the two-step one (`two-step`, the default: all_to_all of W chunks, a mean
  per chunk with a server residual, all_gather of the encoded mean chunks), with error feedback.

Bytes per rank per average, two columns:
- handed over: what compressed_mean / Group.all_reduce return (and strategies add to comm_bytes);
- wire: what rank 1 sends on the wire, by the algorithm (gloo's ring all-reduce: 2(W-1)/W·4n; the
  all_gather scheme: (W-1) payloads; the two-step: the W-1 chunks it addresses to others, then its
  padded mean chunk to W-1 ranks), computed from the chunk sizes, not sniffed.

On a 2-core machine 8 processes share 2 cores: the seconds there are as much decoding and the cores'
contention as the loopback's bytes; the bytes are what a real link would carry.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

WORLDS = (2, 4, 8)
SIZES = (1_000_000, 10_000_000)
REPEATS = 5
CASES = (("fp32", "none", None), ("fp16", "fp16", "all-gather"), ("fp16", "fp16", "two-step"),
         ("int8", "int8", "all-gather"), ("int8", "int8", "two-step"))


def wire_bytes(kind: str, scheme: str, n: int, world: int, rank: int) -> int:
    """Bytes rank `rank` sends on the wire for one average (see the module docstring)."""
    from dptrain.strategies.compression import chunk_bounds, payload_bytes

    if kind == "none":
        return round(2 * (world - 1) / world * 4 * n)
    if scheme == "all-gather":
        return (world - 1) * payload_bytes(kind, n)
    sizes = [payload_bytes(kind, end - start) for start, end in chunk_bounds(kind, n, world)]
    return sum(sizes) - sizes[rank] + (world - 1) * max(sizes)


def worker(rank: int, world: int, port: int, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from dptrain.runtime.group import Group
    from dptrain.strategies.compression import ErrorFeedback, compressed_mean

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    group = Group.default(600.0)
    rows = []
    try:
        for n in SIZES:
            generator = torch.Generator().manual_seed(rank)
            for label, kind, scheme in CASES:
                feedback = ErrorFeedback(kind)
                seconds, handed = [], None
                for repeat in range(REPEATS + 1):
                    change = torch.randn(n, generator=generator) * 0.01
                    group.barrier("a benchmark's start")
                    begun = time.perf_counter()
                    if kind == "none":
                        mean = change.clone()
                        sent = group.all_reduce(mean)
                        mean.div_(world)
                    else:
                        mean, sent = compressed_mean(change, feedback, group=group, scheme=scheme)
                    took = torch.tensor([time.perf_counter() - begun], dtype=torch.float64)
                    group.all_reduce(took, "max")  # the average takes as long as its slowest rank
                    if repeat:  # the first is a warm-up
                        seconds.append(float(took.item()))
                    handed = sent
                    del mean
                rows.append({"workers": world, "elements": n, "case": label, "scheme": scheme or "all_reduce",
                             "handed_over_bytes": handed, "wire_bytes": wire_bytes(kind, scheme, n, world, rank),
                             "seconds_median": statistics.median(seconds), "seconds": seconds})
        if rank == 1:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def measure(world: int) -> list[dict]:
    import multiprocessing as mp

    from dptrain.runtime.env import free_port

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=worker, args=(rank, world, port, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    rows = results.get(timeout=3600)
    for proc in procs:
        proc.join(600)
        if proc.exitcode != 0:
            raise RuntimeError(f"a rank of the {world}-worker run ended with {proc.exitcode}")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| W | n | case | scheme | handed over (bytes) | wire, rank 1 (bytes) | wire / fp32's | seconds (median of 5) |",
             "|---:|---:|---|---|---:|---:|---:|---:|"]
    fp32 = {(r["workers"], r["elements"]): r["wire_bytes"] for r in rows if r["case"] == "fp32"}
    for r in rows:
        ratio = r["wire_bytes"] / fp32[(r["workers"], r["elements"])]
        lines.append(f"| {r['workers']} | {r['elements']:,} | {r['case']} | {r['scheme']} | {r['handed_over_bytes']:,} | "
                     f"{r['wire_bytes']:,} | {ratio:.3f} | {r['seconds_median']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/compression-scaling")
    worlds = [int(w) for w in sys.argv[2].split(",")] if len(sys.argv) > 2 else list(WORLDS)
    rows = []
    for world in worlds:
        begun = time.perf_counter()
        rows += measure(world)
        print(f"W = {world}: {time.perf_counter() - begun:.0f} s", flush=True)
    meta = {"cpus": os.cpu_count(), "platform": platform.platform(), "repeats": REPEATS,
            "backend": "gloo on 127.0.0.1", "rank_reported": 1}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(
        f"# Compressed averages against fp32's all-reduce (gloo on 127.0.0.1, {os.cpu_count()} CPUs)\n\n"
        f"Written by `benchmarks/compression_scaling.py`; bytes are rank 1's per average, seconds the "
        f"slowest rank's, median of {REPEATS}.\n\n{table(rows)}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
