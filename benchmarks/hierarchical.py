"""Flat allreduce, flat sync and hierarchical on 2 emulated hosts x 2 ranks at 100 Mbit/s: their communication alone.

    python benchmarks/hierarchical.py benchmarks/results/hierarchical    # as root; after `dptrain bench ... --out` there

The training runs themselves come from `dptrain bench --ranks-per-host 2 --bandwidth 100mbit`
(benchmarks/README.md has the command); on a shared machine their epoch times carry the other
processes' noise. This script times each strategy's collectives alone, in the same emulated
network (2 network namespaces, 2 ranks in each, 100 Mbit/s between them, gloo over eth0), on
the cnn's parameters (digits: 1 x 8 x 8, 10 classes), each collective `REPEATS` times, and
keeps the median of the slowest rank's time:

- step_flat: one all-reduce of the gradients among all 4 ranks (allreduce's step: DDP hands
  the cnn's gradients to gloo as one bucket);
- step_node: the same among the 2 ranks of a node (hierarchical's step);
- average_flat: sync's average (average_module among all 4 ranks);
- average_leaders: hierarchical's average (average_module among the 2 leaders, then
  broadcast_module inside each node).

Communication per epoch = steps x step + average (one average per epoch, --sync-every 1). It
writes OUT/communication.json (with the bytes each run of OUT/runs handed to collectives, by
link) and draws OUT/hierarchical.png from it and OUT/results.json.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HOSTS, RANKS_PER_HOST, RATE, REPEATS, PORT = 2, 2, "100mbit", 20, 29611


def worker() -> None:
    import torch
    import torch.distributed as dist

    from dptrain.models.zoo import cnn
    from dptrain.runtime.group import Group
    from dptrain.strategies.collectives import average_module, broadcast_module

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{PORT}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    nodes = [list(range(first, first + RANKS_PER_HOST)) for first in range(0, world, RANKS_PER_HOST)]
    job = Group.default()  # dptrain's communication seam over the group just made
    node_group = job.split(nodes, name="a host")
    leaders = [node[0] for node in nodes]
    leader_group = job.subgroup(leaders, name="the leaders")
    torch.manual_seed(rank)
    model = cnn((1, 8, 8), 10)
    gradients = torch.randn(sum(p.numel() for p in model.parameters()))

    def hierarchical_average() -> None:
        if leader_group is not None:
            average_module(model, group=leader_group)
        broadcast_module(model, src=0, group=node_group)  # from the host's leader

    operations = {
        "step_flat": lambda: dist.all_reduce(gradients),
        "step_node": lambda: node_group.all_reduce(gradients),
        "average_flat": lambda: average_module(model),
        "average_leaders": hierarchical_average,
    }
    seconds = {}
    for name, operation in operations.items():
        times = []
        for _ in range(REPEATS + 2):  # the first two warm the connections up
            dist.barrier()
            start = time.perf_counter()
            operation()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times.append(took.item())
        seconds[name] = statistics.median(times[2:])
    if rank == 0:
        print(json.dumps({"seconds": seconds, "model_parameters": gradients.numel()}))
    dist.destroy_process_group()


def measure() -> dict:
    from dptrain.bench.netns import INTERFACE, EmulatedNetwork, measure_link

    with EmulatedNetwork(HOSTS, RATE, tag=f"hc{os.getpid()}") as net:
        link = measure_link(net)
        world = HOSTS * RANKS_PER_HOST
        procs = []
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": net.address(0),
                   "GLOO_SOCKET_IFNAME": INTERFACE, "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen(net.exec_prefix(rank // RANKS_PER_HOST) +
                                          [sys.executable, __file__, "--worker"], env=env,
                                          stdout=subprocess.PIPE, text=True))
        try:
            output = procs[0].communicate(timeout=600)[0]
            for proc in procs[1:]:
                proc.wait(timeout=60)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if any(proc.returncode for proc in procs):
            raise SystemExit(f"a worker failed: exit codes {[proc.returncode for proc in procs]}")
    return {**json.loads(output), "link": link, "hosts": HOSTS, "ranks_per_host": RANKS_PER_HOST, "rate": RATE,
            "repeats": REPEATS}


def per_epoch(measured: dict, train_samples: int, batch_size: int, workers: int) -> dict:
    s = measured["seconds"]
    steps = math.ceil(math.ceil(train_samples / workers) / batch_size)
    return {"steps_per_epoch": steps,
            "allreduce": steps * s["step_flat"],
            "sync": s["average_flat"],
            "hierarchical": steps * s["step_node"] + s["average_leaders"]}


def plot(out: Path, summary: list[dict], communication: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["allreduce", "sync", "hierarchical"]
    rows = {row["strategy"]: row for row in summary if row["strategy"] in names}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(names, [rows[n]["epoch_seconds"] for n in names], color="tab:blue")
    axes[0].set_title("median epoch in training (s)")
    axes[1].bar(names, [communication[n] for n in names], color="tab:orange")
    axes[1].set_title("communication per epoch, alone (s)")
    axes[2].bar(names, [rows[n]["final_accuracy"] for n in names], color="tab:green")
    axes[2].set_title("final test accuracy")
    for axis in axes:
        axis.tick_params(axis="x", labelsize=9)
    fig.suptitle("cnn on digits, 2 emulated hosts x 2 ranks, 100 Mbit/s between hosts")
    fig.tight_layout()
    path = out / "hierarchical.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    if sys.argv[1:] == ["--worker"]:
        worker()
        return 0
    out = Path(sys.argv[1])
    results = json.loads((out / "results.json").read_text())
    first = results["runs"][0]
    measured = measure()
    measured["per_epoch_seconds"] = per_epoch(measured, first["train_samples"], first["batch_size"], first["workers"])
    # What each run handed to collectives, by link (the run directories are not kept in the repository).
    measured["bytes_by_run"] = {}
    for summary_file in sorted((out / "runs").glob("*/summary.json")):
        summary = json.loads(summary_file.read_text())
        measured["bytes_by_run"][summary_file.parent.name] = {
            key: summary[key] for key in ("comm_bytes", "intra_node_bytes", "inter_node_bytes",
                                          "inter_node_bytes_per_worker", "averages") if key in summary}
    (out / "communication.json").write_text(json.dumps(measured, indent=1) + "\n")
    print(json.dumps(measured, indent=1))
    print(plot(out, results["summary"], measured["per_epoch_seconds"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
