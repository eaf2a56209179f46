"""One rank of benchmarks/scale.py (and tests/test_scale.py): every strategy in turn on a tiny model, recorded.

    dptrain run --workers W benchmarks/scale_worker.py OUT [STRATEGY ...]

Each rank trains the same 6-8-3 MLP on `SAMPLES_PER_RANK * W + W // 2` rows (so shards and
fedavg's partitions are unequal by one row) for one epoch under each strategy, in this one process
and process group, and writes OUT/rankN.pt: per strategy, the model it averaged or merged (its
replica), the final model, comm_bytes, every row index it read for training in the order read and
where each step's rows end; for the process: when it started, imported torch, joined and first stepped,
its peak RSS, open descriptors, threads, heartbeat round trips; rank 0 adds the store's key count.
benchmarks/scale.py checks the exact properties from these files.
"""

from __future__ import annotations

import time

STARTED = time.time()

import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

IMPORTED = time.time()

from dptrain.runtime.distributed import DistContext, destroy_process_group, exit_process, init_process_group  # noqa: E402
from dptrain.runtime.env import detect  # noqa: E402
from dptrain.runtime.heartbeat import default_store  # noqa: E402
from dptrain.strategies import AllReduce, Async, FedAvg, Sync  # noqa: E402
from dptrain.strategies.asynchronous import flat_state  # noqa: E402
from dptrain.train.trainer import Trainer  # noqa: E402

STRATEGIES = ("allreduce", "sync", "async", "fedavg")
SAMPLES_PER_RANK, BATCH, SEED, LR = 8, 4, 3, 0.1


def samples(world: int) -> int:
    return SAMPLES_PER_RANK * world + world // 2


def data(world: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    n = samples(world)
    return rng.normal(size=(n, 6)).astype(np.float32), rng.integers(0, 3, size=n).astype(np.int64)


def model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


class Recorded(Dataset):
    """The rows, remembering which ones training read (evaluation and the average check run without grad)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y, self.targets = torch.from_numpy(x), torch.from_numpy(y), y
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        if torch.is_grad_enabled():
            self.read.append(int(index))
        return self.x[index], self.y[index]


class RecordingSync(Sync):
    def end_epoch(self, epoch):
        self.replica = flat_state(self.model)
        return super().end_epoch(epoch)


class RecordingAsync(Async):
    def merge_now(self):
        self.replica = flat_state(self.model)
        return super().merge_now()


class RecordingFedAvg(FedAvg):
    def aggregate(self, round_index):
        self.replica = flat_state(self.model)
        self.partition_size = len(self.parts[self.ctx.rank])
        super().aggregate(round_index)


def make(name: str):
    return {"allreduce": AllReduce, "sync": lambda: RecordingSync(every=1), "async": RecordingAsync,
            "fedavg": lambda: RecordingFedAvg(partition="iid")}[name]()


def train(name: str, world: int, marks: dict) -> dict:
    """One epoch of strategy `name`; what it read, averaged and sent."""
    x, y = data(world)
    rows = Recorded(x, y)
    net = model()
    steps: list[int] = []

    def mark(module, inputs):
        if torch.is_grad_enabled():
            marks.setdefault("first_step", time.time())
            steps.append(len(rows.read))

    net.register_forward_pre_hook(mark)
    strategy = make(name)
    begun = time.time()
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=LR), "cross-entropy", strategy, batch_size=BATCH,
                      seed=SEED, verbose=False, progress=False, check_averages=False)
    trainer.fit(rows, epochs=1)
    summary = strategy.summary()
    return {"seconds": time.time() - begun, "final": flat_state(net),
            "replica": getattr(strategy, "replica", None), "comm_bytes": strategy.comm_bytes, "read": rows.read,
            "step_ends": steps, "partition_size": getattr(strategy, "partition_size", None), "summary": summary}


def join() -> DistContext:
    return init_process_group(detect(), timeout=1800.0)  # 128 ranks importing torch on two cores take minutes


def run(ctx: DistContext, names: list[str]) -> dict:
    """Every strategy of `names` in turn in this rank's process group; the record."""
    joined = time.time()
    marks: dict = {}
    record: dict = {"rank": ctx.rank, "world": ctx.world_size, "started": STARTED, "imported": IMPORTED,
                    "joined": joined, "strategies": {}}
    for name in names:
        record["strategies"][name] = train(name, ctx.world_size, marks)
        if ctx.rank == 0:
            print(f"scale: W={ctx.world_size} {name} done in {record['strategies'][name]['seconds']:.1f} s",
                  flush=True)
    record["first_step"] = marks["first_step"]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record["peak_rss_mb"] = usage.ru_maxrss / 1024
    record["cpu_s"] = usage.ru_utime + usage.ru_stime  # since the process started (torch's import included)
    with open("/proc/self/smaps_rollup") as rollup:  # RSS counts torch's shared libraries in every rank; PSS shares them
        sizes = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in rollup if line.split()[-1] == "kB"}
    record["pss_mb"] = sizes["Pss"]
    record["private_mb"] = sizes["Private_Clean"] + sizes["Private_Dirty"]  # this rank's alone
    record["rss_mb"] = sizes["Rss"]
    record["descriptors"] = len(os.listdir("/proc/self/fd"))
    record["python_threads"] = sorted(t.name for t in threading.enumerate())
    with open("/proc/self/status") as status:
        record["os_threads"] = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    heartbeat = ctx.heartbeat
    record["beats"] = heartbeat.beats if heartbeat else 0
    record["slowest_beat_s"] = heartbeat.slowest_beat if heartbeat else 0.0
    if ctx.rank == 0:
        record["store_keys"] = default_store().num_keys()
    return record


def main(out: Path, names: list[str]) -> None:
    ctx = join()
    record = run(ctx, names)
    torch.save(record, out / f"rank{ctx.rank}.pt")
    # Rank 0 hosts the store: it leaves last, once every rank has written its record.
    ctx.group.barrier("the end of the scale run")
    destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or list(STRATEGIES))
    exit_process(0)
