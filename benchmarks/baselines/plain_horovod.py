"""Baseline: a plain Horovod training script, written from Horovod's PyTorch guide (used only when horovod imports).

Only the data set and the seeded model come from dptrain (through common.py); the rest is
Horovod's recipe: hvd.init, a DistributedSampler over hvd.size() ranks, broadcast of the
initial parameters and optimizer state, hvd.DistributedOptimizer, one test pass per epoch.

    horovodrun --gloo -np 2 -H localhost:2 python benchmarks/baselines/plain_horovod.py --out runs/horovod
"""

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from common import arguments, data_and_model, fit, shard_counts, write_run


def main():
    args = arguments(__doc__.splitlines()[0])
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    train_set, x_test, y_test, model = data_and_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    def test_accuracy():
        counts = hvd.allreduce(shard_counts(model, x_test, y_test, rank, world), op=hvd.Sum)
        return (counts[0] / counts[1]).item()

    records, wall, samples = fit(model, optimizer, loader, args.epochs, test_accuracy, sampler)
    total = hvd.allreduce(torch.tensor([samples], dtype=torch.float64), op=hvd.Sum)
    if rank == 0:
        write_run(args.out, "horovod", world, records, wall, total.item(), model)

if __name__ == "__main__":
    main()
