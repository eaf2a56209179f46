"""The user Dataset of issue 20: 16 features, 4 classes whose means differ by 1 in every feature, 2,000
samples computed in __getitem__ (`--data blobs_factory:make`; 20 % is held out for testing)."""

import torch
from torch.utils.data import Dataset


class Blobs(Dataset):
    def __init__(self, n: int = 2000, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 4, (n,), generator=generator)
        self.noise = torch.randn(n, 16, generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index):
        label = self.y[index]
        return self.noise[index] + float(label), label


def make():
    return Blobs()
