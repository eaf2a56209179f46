"""A textbook PyTorch DDP script, for timing `dptrain train`'s start-up against torchrun (benchmarks/startup.py).

Nothing of dptrain: scikit-learn's digits with a stratified train/test split, a
DistributedSampler, DistributedDataParallel over gloo on the CPU, SGD, the same MLP
(64-128-64-10), batch size and learning rate as `dptrain train --model mlp`, then the test
accuracy at the end, as the PyTorch DDP tutorial writes it.

    torchrun --nproc-per-node 2 benchmarks/baselines/textbook_ddp.py --epochs 1

With --snapshot PATH it is the fault-tolerant script of PyTorch's torchrun tutorial ("Fault-tolerant
Distributed Training with torchrun"): it loads the snapshot if there is one and rank 0 saves one after
every epoch, so that torchrun --max-restarts can restart every worker from it (benchmarks/elastic.py).
DPTRAIN_BENCH_KILL=RANK:STEP kills that rank with SIGKILL after that many training steps, once (a marker
file next to the snapshot remembers it). With --snapshot rank 0 also prints `epoch N/EPOCHS done` at the end of each epoch, after its
snapshot is saved, for benchmarks/elastic.py to time the epochs by.
"""

import argparse
import os
import signal

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--snapshot", default=None, help="load it if it exists; rank 0 saves it every epoch")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    train_set = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    first_epoch = 0
    if args.snapshot and os.path.exists(args.snapshot):
        snapshot = torch.load(args.snapshot, weights_only=True)
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        first_epoch = snapshot["epochs_run"]
    kill = os.environ.get("DPTRAIN_BENCH_KILL")
    kill_rank, kill_step = (int(part) for part in kill.split(":")) if kill else (-1, -1)
    marker = f"{args.snapshot}.killed" if args.snapshot else None

    step = first_epoch * len(loader)
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        for xb, yb in loader:
            optimizer.zero_grad()
            loss_fn(ddp_model(xb), yb).backward()
            optimizer.step()
            step += 1
            if rank == kill_rank and step == kill_step and marker and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        if args.snapshot and rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epochs_run": epoch + 1},
                       args.snapshot + ".tmp")
            os.replace(args.snapshot + ".tmp", args.snapshot)
        if args.snapshot and rank == 0:  # the epoch boundary benchmarks/elastic.py stamps
            print(f"epoch {epoch + 1}/{args.epochs} done", flush=True)

    if rank == 0:  # the replicas are identical: one rank scores the test set
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        print(f"test accuracy {accuracy:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
