"""Baseline: a plain PyTorch FSDP2 training script (fully_shard), written from torch's FSDP2 documentation.

Only the data set and the seeded model come from dptrain (dptrain.data.load_dataset, dptrain.models.build_model,
through common.py's helpers); the rest is torch alone: init_process_group("gloo") from the environment torchrun
sets, a DeviceMesh of all ranks (`--shard-size` = the world: FSDP) or of replica groups x shards (HSDP:
`init_device_mesh(..., (W/S, S))`), `fully_shard` on each unit, then on the root, a DistributedSampler, SGD with
momentum, and a test pass at the end.

The units are those dptrain chooses by default (dptrain.runtime.sharded.units_of, written out again here): each
child of the root, and each item of a child ModuleList, Sequential or ModuleDict, holding at least 5 % of the
parameters.

    torchrun --nproc-per-node 2 benchmarks/baselines/plain_fsdp.py --shard-size 2 --out plain.json

Rank 0 writes OUT (JSON): per epoch the samples per second of the ranks' training steps, summed over the ranks
(each rank's samples over its own seconds, as dptrain's metrics.jsonl counts them), the test accuracy at the end,
and per rank the bytes of its parameter, gradient and optimizer-state shards and its peak resident memory. The
ranks hand their numbers to rank 0 as tensors.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from common import _tensors, exit_without_finalizing, shard_counts

UNIT_SHARE = 0.05
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--hidden", default="512,512", help="the mlp's hidden widths, comma-separated")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", type=int, required=True, help="ranks per replica group (the world: FSDP)")
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def units(model):
    """The modules to shard before the root: children (or items of a container child) with >= UNIT_SHARE of it."""
    total = sum(p.numel() for p in model.parameters())
    chosen = []

    def visit(module):
        for child in module.children():
            if isinstance(child, CONTAINERS):
                visit(child)
            elif sum(p.numel() for p in child.parameters()) >= UNIT_SHARE * total:
                chosen.append(child)

    visit(model)
    return chosen


def peak_rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def local_bytes(tensors):
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def main():
    args = arguments()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.shard_size == world:
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (world // args.shard_size, args.shard_size),
                                mesh_dim_names=("replicate", "shard"))

    from dptrain.data import load_dataset
    from dptrain.models import build_model

    data = load_dataset(args.dataset, seed=args.seed)
    x_train, y_train = _tensors(data.x_train, data.y_train)
    x_test, y_test = _tensors(data.x_test, data.y_test)
    torch.manual_seed(args.seed)
    model = build_model("mlp", data.input_shape, data.num_outputs,
                        options={"hidden": [int(h) for h in args.hidden.split(",")]})
    for unit in units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    train_set = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()

    rates = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        samples, started = 0, time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            samples += len(x)
        rate = torch.tensor([samples / (time.perf_counter() - started)], dtype=torch.float64)
        dist.all_reduce(rate)
        rates.append(rate.item())

    # Counted before the test pass: after a forward without backward FSDP2 keeps the root's parameters whole.
    held = [local_bytes(model.parameters()),
            local_bytes(p.grad for p in model.parameters() if p.grad is not None),
            local_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)]

    model.eval()
    with torch.no_grad():
        counts = shard_counts(model, x_test, y_test, rank, world)
    dist.all_reduce(counts)
    held = torch.tensor(held + [peak_rss()], dtype=torch.int64)
    every = [torch.zeros_like(held) for _ in range(world)]
    dist.all_gather(every, held)
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "samples_per_second": rates, "test_accuracy": (counts[0] / counts[1]).item(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "ranks": [dict(zip(("params", "grads", "optimizer", "peak_rss"), row.tolist())) for row in every]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing()
