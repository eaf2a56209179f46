"""Baseline: a plain PyTorch DistributedDataParallel training script, written from the PyTorch DDP tutorial.

Only the data set and the seeded model come from dptrain (through common.py); the rest is
textbook PyTorch: init_process_group from the environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, as torchrun sets them), a DistributedSampler, DDP, SGD, one test pass per epoch.

    torchrun --nproc-per-node 2 benchmarks/baselines/plain_ddp.py --epochs 5 --out runs/plain-ddp
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from common import arguments, data_and_model, exit_without_finalizing, fit, shard_counts, write_run


def main():
    args = arguments(__doc__.splitlines()[0])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_set, x_test, y_test, model = data_and_model(args)
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=args.momentum)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    def test_accuracy():
        # The replicas are identical: each rank scores its slice of the test set, the counts are summed.
        counts = shard_counts(model, x_test, y_test, rank, world)
        dist.all_reduce(counts)
        return (counts[0] / counts[1]).item()

    records, wall, samples = fit(ddp_model, optimizer, loader, args.epochs, test_accuracy, sampler)
    total = torch.tensor([samples], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        write_run(args.out, "plain-ddp", world, records, wall, total.item(), model)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
    exit_without_finalizing()
