"""Baseline: a plain single-process PyTorch training loop, no distribution at all.

Only the data set and the seeded model come from dptrain (through common.py); the loop is
textbook PyTorch: a shuffled DataLoader, SGD, one test pass per epoch.

    python benchmarks/baselines/plain_loop.py --epochs 5 --out runs/plain-loop
"""

import torch
from torch.utils.data import DataLoader

from common import arguments, data_and_model, fit, write_run


def main():
    args = arguments(__doc__.splitlines()[0])
    train_set, x_test, y_test, model = data_and_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))

    def test_accuracy():
        return (model(x_test).argmax(1) == y_test).float().mean().item()

    records, wall, samples = fit(model, optimizer, loader, args.epochs, test_accuracy)
    write_run(args.out, "plain-loop", 1, records, wall, samples, model, comm_bytes=0)

if __name__ == "__main__":
    main()
