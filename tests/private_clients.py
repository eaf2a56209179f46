"""Four clients, each with its own files in its own directory (clients/client{k}/data.npz), for the tests of
each client's own data (dptrain.data.private): `--data private_clients.py:own_data --strategy fedavg`.

Every call records who opened which client's files in clients/opened.txt ('launcher' for the launching process)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

SIZES = (30, 50, 70, 90)


def write_clients(root: Path, sizes=SIZES) -> None:
    for client, size in enumerate(sizes):
        rng = np.random.default_rng(100 + client)
        y = rng.integers(0, 3, size=size + 10)
        x = (rng.normal(size=(size + 10, 6)) + y[:, None] * (1.0 + 0.5 * client)).astype(np.float32)
        folder = root / "clients" / f"client{client}"
        folder.mkdir(parents=True)
        np.savez(folder / "data.npz", x=x[:size], y=y[:size], x_test=x[size:], y_test=y[size:])


def own_data(rank, world):
    with open(Path("clients") / "opened.txt", "a") as handle:
        handle.write(f"{os.environ.get('RANK', 'launcher')} {rank} {world}\n")
    arrays = np.load(Path("clients") / f"client{rank}" / "data.npz")
    return (TensorDataset(torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])),
            TensorDataset(torch.from_numpy(arrays["x_test"]), torch.from_numpy(arrays["y_test"])))
