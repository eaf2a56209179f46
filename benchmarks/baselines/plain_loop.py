"""Baseline: a plain single-process PyTorch training loop, no distribution at all.

Only the data set and the seeded model come from dptrain (through common.py); the loop is
textbook PyTorch: a shuffled DataLoader, SGD, one test pass per epoch.

    python benchmarks/baselines/plain_loop.py --epochs 5 --out runs/plain-loop
"""

import time

import torch
from torch.utils.data import DataLoader

from common import arguments, data_and_model, write_run


def main():
    args = arguments(__doc__.splitlines()[0])
    train_set, x_test, y_test, model = data_and_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))

    records = []
    started = time.perf_counter()
    samples = 0
    for epoch in range(args.epochs):
        epoch_start = time.perf_counter()
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            samples += len(x)
        epoch_seconds = time.perf_counter() - epoch_start
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        records.append({"epoch": epoch + 1, "test_accuracy": accuracy, "epoch_seconds": epoch_seconds,
                        "wall_seconds": time.perf_counter() - started})
    write_run(args.out, "plain-loop", 1, records, time.perf_counter() - started, samples, model, comm_bytes=0)


if __name__ == "__main__":
    main()
