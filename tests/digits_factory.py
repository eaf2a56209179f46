"""A user's own data factory for the launcher tests (`--data digits_factory:make`, with tests/ on
PYTHONPATH): sklearn's digits as map-style torch Datasets, split as the built-in digits is."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


class Digits(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y
        self.targets = y  # partitioners read labels from here

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return torch.from_numpy(self.x[index]), int(self.y[index])


def make():
    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    train, test = train_test_split(np.arange(len(x)), test_size=0.2, random_state=0, stratify=bunch.target)
    return Digits(x[train], bunch.target[train]), Digits(x[test], bunch.target[test])
