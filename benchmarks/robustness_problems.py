"""The 12 training problems of the robustness benchmark (benchmarks/robustness.py, issue 20).

Each problem is what a user could have written for `dptrain train`: a data factory
(`--data benchmarks/robustness_problems.py:<name>_data`) returning `(train, test)` map-style
Datasets that compute their items in `__getitem__`, a model factory (`--model ...:<name>_model`)
taking `input_shape` and `num_outputs`, and the flags the user would pass (often none: the
defaults are part of what is tested: "the default lr" is whatever dptrain picks when --lr is not
given, recorded in each run's config.yaml). Plain torch, numpy and scikit-learn's bundled digits
only; nothing is downloaded.

The data are generated from a fixed seed inside the factory, so every run sees the same samples;
`--seed` varies only the initialisation and the sample order. Regression targets are
standardised (mean 0, variance 1 over all samples), and the benchmark's score for them is
R² = 1 - test MSE / var(test targets), in points; for classification it is test accuracy, in points.

The split into a tuning half (to choose rules on) and a held-out half (to check them on) was
fixed before any result was seen: TUNING and HELD_OUT below.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class Problem:
    name: str
    data: str  # data factory in this file
    model: str  # model factory in this file
    epochs: int
    flags: tuple[str, ...]  # everything else the user passes (optimizer, batch size, ...)
    task: str  # "classify" (score: accuracy) or "regress" (score: R²)
    description: str


# ---------------------------------------------------------------------------------------------------
# Datasets: items computed in __getitem__ from stored tensors, as a user's Dataset would.

class ArrayDataset(Dataset):
    """(x[i], y[i]) with an optional per-item transform of x (scaling, casting) done on access."""

    def __init__(self, x: np.ndarray, y: np.ndarray, transform=None):
        self.x = torch.as_tensor(x)
        self.y = torch.as_tensor(y)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        x = self.x[index]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.y[index]


class BlobDataset(Dataset):
    """Gaussian blobs: sample i is means[label_i] + noise_i, computed on access."""

    def __init__(self, means: torch.Tensor, labels: torch.Tensor, noise: torch.Tensor):
        self.means, self.labels, self.noise = means, labels, noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        label = self.labels[index]
        return self.means[label] + self.noise[index], label


def _split(x: np.ndarray, y: np.ndarray, test: int, seed: int) -> tuple:
    """(x_train, y_train, x_test, y_test): `test` samples held out, chosen by a fixed seed."""
    order = np.random.default_rng(seed).permutation(len(y))
    keep, hold = order[test:], order[:test]
    return x[keep], y[keep], x[hold], y[hold]


def _standardise(y: np.ndarray) -> np.ndarray:
    return ((y - y.mean()) / y.std()).astype(np.float32)


def _to_datasets(arrays: tuple, transform=None) -> tuple[Dataset, Dataset]:
    x_train, y_train, x_test, y_test = arrays
    return ArrayDataset(x_train, y_train, transform), ArrayDataset(x_test, y_test, transform)


# ---------------------------------------------------------------------------------------------------
# 1. blobs-mlp: the case of the issue.

@functools.lru_cache(maxsize=None)
def _blobs():
    rng = np.random.default_rng(101)
    n, features, classes = 2000, 16, 4
    means = np.arange(classes, dtype=np.float32)[:, None] * np.ones((1, features), np.float32)  # class c: c everywhere
    labels = rng.integers(0, classes, n)
    noise = rng.standard_normal((n, features)).astype(np.float32)
    order = rng.permutation(n)
    test, train = order[:400], order[400:]
    return means, labels, noise, train, test


def blobs_data():
    means, labels, noise, train, test = _blobs()
    means = torch.as_tensor(means)
    return (BlobDataset(means, torch.as_tensor(labels[train]), torch.as_tensor(noise[train])),
            BlobDataset(means, torch.as_tensor(labels[test]), torch.as_tensor(noise[test])))


def blobs_model(input_shape, num_outputs):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 64), nn.ReLU(),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, num_outputs))


# ---------------------------------------------------------------------------------------------------
# 2. digits-lenet: scikit-learn's bundled 8x8 digits.

@functools.lru_cache(maxsize=None)
def _digits():
    # The file sklearn.datasets.load_digits reads, bundled with scikit-learn (no download), read
    # without importing scikit-learn itself (3 s on this machine, in every rank).
    import importlib.util
    import os

    package = os.path.dirname(importlib.util.find_spec("sklearn").origin)
    table = np.loadtxt(os.path.join(package, "datasets", "data", "digits.csv.gz"), delimiter=",")
    x = table[:, :-1].astype(np.float32).reshape(-1, 1, 8, 8)  # (1797, 1, 8, 8), values 0..16
    y = table[:, -1].astype(np.int64)
    return _split(x, y, 360, 202)


def digits_data():
    return _to_datasets(_digits(), transform=lambda x: x / 16.0)  # scaled to [0, 1] on access


def digits_model(input_shape, num_outputs):
    return nn.Sequential(
        nn.Conv2d(input_shape[0], 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 8 x 4 x 4
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 16 x 2 x 2
        nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_outputs))


# ---------------------------------------------------------------------------------------------------
# 3. shapes-cnn-bn: 16x16 outlines of squares, crosses, circles and diagonal lines.

def _draw_shape(kind: int, size: int, rng) -> np.ndarray:
    image = np.zeros((size, size), np.float32)
    radius = int(rng.integers(3, 6))
    cy, cx = (int(v) for v in rng.integers(radius, size - radius, 2))
    yy, xx = np.mgrid[0:size, 0:size]
    if kind == 0:  # square outline
        inside = (np.abs(yy - cy) <= radius) & (np.abs(xx - cx) <= radius)
        core = (np.abs(yy - cy) <= radius - 1) & (np.abs(xx - cx) <= radius - 1)
        image[inside & ~core] = 1.0
    elif kind == 1:  # cross
        image[(np.abs(yy - cy) <= radius) & (xx == cx)] = 1.0
        image[(np.abs(xx - cx) <= radius) & (yy == cy)] = 1.0
    elif kind == 2:  # circle outline
        distance = np.sqrt((yy - cy) ** 2 + (xx - cx) ** 2)
        image[np.abs(distance - radius) < 0.7] = 1.0
    else:  # diagonal line, either direction
        sign = 1 if rng.random() < 0.5 else -1
        image[(np.abs((yy - cy) - sign * (xx - cx)) < 0.6) & (np.abs(xx - cx) <= radius)] = 1.0
    return image


@functools.lru_cache(maxsize=None)
def _shapes():
    rng = np.random.default_rng(303)
    n, size = 3000, 16
    y = rng.integers(0, 4, n).astype(np.int64)
    images = np.stack([_draw_shape(int(k), size, rng) for k in y])
    x = (images * rng.uniform(0.3, 1.0, (n, 1, 1)) + rng.normal(0, 0.3, images.shape)).astype(np.float32)
    return _split(x[:, None], y, 600, 304)


def shapes_data():
    return _to_datasets(_shapes())


def shapes_model(input_shape, num_outputs):
    return nn.Sequential(
        nn.Conv2d(input_shape[0], 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),  # 8x8
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),  # 4x4
        nn.Flatten(), nn.Linear(16 * 16, num_outputs))


# ---------------------------------------------------------------------------------------------------
# 4. seq-gru: which of 3 short patterns is hidden in a noisy sequence.

@functools.lru_cache(maxsize=None)
def _sequences():
    rng = np.random.default_rng(404)
    n, length, dims, classes, width = 1200, 20, 4, 3, 5
    patterns = rng.choice([-1.0, 1.0], size=(classes, width, dims)).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int64)
    x = rng.standard_normal((n, length, dims)).astype(np.float32)
    starts = rng.integers(0, length - width + 1, n)
    for i in range(n):
        x[i, starts[i]:starts[i] + width] += patterns[y[i]]
    return _split(x, y, 240, 405)


def seq_data():
    return _to_datasets(_sequences())


class GRUClassifier(nn.Module):
    def __init__(self, inputs: int, hidden: int, outputs: int):
        super().__init__()
        self.gru = nn.GRU(inputs, hidden, batch_first=True)
        self.head = nn.Linear(hidden, outputs)

    def forward(self, x):
        _, last = self.gru(x)
        return self.head(last[-1])


def seq_model(input_shape, num_outputs):
    return GRUClassifier(input_shape[-1], 32, num_outputs)


# ---------------------------------------------------------------------------------------------------
# 5. regress-unnormalised: raw features on scales from 1 to 100.

@functools.lru_cache(maxsize=None)
def _unnormalised():
    rng = np.random.default_rng(505)
    n, features = 2000, 10
    u = rng.uniform(0, 1, (n, features))
    scales = np.logspace(0, 2, features)  # 1 ... 100
    x = (u * scales).astype(np.float32)  # what the user feeds: raw, positive, unscaled
    z = 2 * u - 1
    target = (np.sin(2 * z[:, 9]) + z[:, 8] * z[:, 7] + np.tanh(2 * z[:, 6]) + 0.5 * z[:, 5] ** 2 + 0.3 * z[:, 0]
              + 0.15 * rng.standard_normal(n))
    return _split(x, _standardise(target), 400, 506)


def unnormalised_data():
    return _to_datasets(_unnormalised())


def unnormalised_model(input_shape, num_outputs):
    return nn.Sequential(nn.Linear(input_shape[0], 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, num_outputs))


# ---------------------------------------------------------------------------------------------------
# 6. imbalanced-adamw: 5 classes at 70/15/8/5/2 %.

@functools.lru_cache(maxsize=None)
def _imbalanced():
    rng = np.random.default_rng(606)
    n, features = 4000, 20
    frequencies = np.array([0.70, 0.15, 0.08, 0.05, 0.02])
    y = rng.choice(5, size=n, p=frequencies).astype(np.int64)
    means = rng.normal(0, 0.45, (5, features))
    mixing = rng.normal(0, 1, (features, features)) / math.sqrt(features)  # correlated features
    x = ((means[y] + rng.standard_normal((n, features))) @ mixing + 0.5).astype(np.float32)
    return _split(x, y, 800, 607)


def imbalanced_data():
    return _to_datasets(_imbalanced())


def imbalanced_model(input_shape, num_outputs):
    return nn.Sequential(nn.Linear(input_shape[0], 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, num_outputs))


# ---------------------------------------------------------------------------------------------------
# 7. textures-resnet: stripes at 4 orientations, random frequency, phase and colours.

@functools.lru_cache(maxsize=None)
def _textures():
    rng = np.random.default_rng(707)
    n, size = 1600, 16
    y = rng.integers(0, 4, n).astype(np.int64)
    angle = y * (np.pi / 4) + rng.normal(0, 0.12, n)
    frequency = rng.uniform(0.6, 1.6, n)
    phase = rng.uniform(0, 2 * np.pi, n)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    wave = np.sin(frequency[:, None, None] * (np.cos(angle)[:, None, None] * xx + np.sin(angle)[:, None, None] * yy)
                  + phase[:, None, None])  # (n, 16, 16)
    low, high = rng.uniform(0, 1, (n, 3)), rng.uniform(0, 1, (n, 3))  # two colours per image
    mix = (wave[:, None] + 1) / 2  # (n, 1, 16, 16)
    x = low[:, :, None, None] * (1 - mix) + high[:, :, None, None] * mix
    x = (x + rng.normal(0, 0.35, x.shape)).astype(np.float32)  # colour noise
    return _split(x, y, 320, 708)


def textures_data():
    return _to_datasets(_textures())


class Block(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


def textures_model(input_shape, num_outputs):
    return nn.Sequential(
        nn.Conv2d(input_shape[0], 12, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(12), nn.ReLU(),  # 8x8
        Block(12), Block(12), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, num_outputs))


# ---------------------------------------------------------------------------------------------------
# 8. moons-large: 20,000 samples of two moons lifted to 8 features.

@functools.lru_cache(maxsize=None)
def _moons():
    rng = np.random.default_rng(808)
    n = 20000
    y = rng.integers(0, 2, n)
    t = rng.uniform(0, np.pi, n)
    plane = np.where(y[:, None] == 0, np.stack([np.cos(t), np.sin(t)], 1),
                     np.stack([1 - np.cos(t), 0.5 - np.sin(t)], 1))
    plane += rng.normal(0, 0.3, plane.shape)
    lift = rng.normal(0, 1, (2, 8))
    x = (plane @ lift + rng.normal(0, 0.2, (n, 8))).astype(np.float32)
    return _split(x, y.astype(np.int64), 1000, 809)


def moons_data():
    return _to_datasets(_moons())


def moons_model(input_shape, num_outputs):
    return nn.Sequential(nn.Linear(input_shape[0], 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, num_outputs))


# ---------------------------------------------------------------------------------------------------
# 9. waves-conv1d: sine, square, sawtooth or noise bursts, random frequency and phase.

@functools.lru_cache(maxsize=None)
def _waves():
    rng = np.random.default_rng(909)
    n, length = 1600, 64
    y = rng.integers(0, 4, n).astype(np.int64)
    t = np.arange(length)[None, :]
    frequency = rng.uniform(0.03, 0.2, (n, 1))
    phase = rng.uniform(0, 1, (n, 1))
    cycle = (frequency * t + phase) % 1.0
    sine = np.sin(2 * np.pi * cycle)
    square = np.where(cycle < 0.5, 1.0, -1.0)
    saw = 2 * cycle - 1
    bursts = rng.standard_normal((n, length)) * (np.sin(2 * np.pi * cycle) > 0.3)
    signal = np.choose(y[:, None], [sine, square, saw, bursts])
    amplitude = rng.uniform(0.5, 1.5, (n, 1))
    x = (amplitude * signal + rng.normal(0, 0.3, (n, length))).astype(np.float32)[:, None]  # (n, 1, 64)
    return _split(x, y, 320, 910)


def waves_data():
    return _to_datasets(_waves())


def waves_model(input_shape, num_outputs):
    return nn.Sequential(
        nn.Conv1d(input_shape[0], 8, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),  # 32
        nn.Conv1d(8, 16, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),  # 16
        nn.Conv1d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1),
        nn.Flatten(), nn.Linear(16, num_outputs))


# ---------------------------------------------------------------------------------------------------
# 10. tokens-transformer: which token occurs most often in a sequence of 12 (vocabulary 16). (The most
#     frequent of tokens 0..3 only, or 0..7, was learnt to 99-100 % by one worker: too easy to show a loss.)

@functools.lru_cache(maxsize=None)
def _tokens():
    rng = np.random.default_rng(1010)
    n, length, vocab, candidates = 1200, 12, 16, 16
    rows = []
    while len(rows) < n:
        tokens = rng.integers(0, vocab, length)
        counts = np.bincount(tokens, minlength=vocab)[:candidates]
        if (counts == counts.max()).sum() == 1:  # a unique most frequent token
            rows.append(tokens)
    x = np.stack(rows).astype(np.int64)
    y = np.array([np.bincount(r, minlength=vocab)[:candidates].argmax() for r in x], np.int64)
    return _split(x, y, 240, 1011)


def tokens_data():
    return _to_datasets(_tokens())


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, length: int, outputs: int, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(width, outputs)

    def forward(self, tokens):
        h = self.encoder(self.embed(tokens.long()) + self.position)
        return self.head(h.mean(dim=1))


def tokens_model(input_shape, num_outputs):
    return TinyTransformer(16, input_shape[0], num_outputs)


# ---------------------------------------------------------------------------------------------------
# 11. pixels-unnormalised-cnn: where the bright blob is, pixel values 0..255.

@functools.lru_cache(maxsize=None)
def _pixels():
    rng = np.random.default_rng(1111)
    n, size = 2400, 12
    y = rng.integers(0, 3, n).astype(np.int64)
    yy, xx = np.mgrid[0:size, 0:size]
    cx = np.array([2.5, 5.5, 8.5])[y] + rng.normal(0, 1.0, n)
    cy = rng.uniform(2, 9, n)
    blob = np.exp(-((xx[None] - cx[:, None, None]) ** 2 + (yy[None] - cy[:, None, None]) ** 2) / 4.0)
    x = 40 + 120 * blob * rng.uniform(0.4, 1.0, (n, 1, 1)) + rng.normal(0, 45, blob.shape)
    x = np.clip(x, 0, 255).round().astype(np.uint8)[:, None]  # stored as bytes, like decoded images
    return _split(x, y, 480, 1112)


def pixels_data():
    return _to_datasets(_pixels(), transform=lambda x: x.float())  # 0..255, not normalised


def pixels_model(input_shape, num_outputs):
    return nn.Sequential(
        nn.Conv2d(input_shape[0], 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 6x6
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 3x3
        nn.Flatten(), nn.Linear(16 * 9, num_outputs))


# ---------------------------------------------------------------------------------------------------
# 12. regress-sines-long: a sum of sines of 4 inputs, a long run on a small set.

@functools.lru_cache(maxsize=None)
def _sines():
    rng = np.random.default_rng(1212)
    n = 1000
    x = rng.uniform(-1, 1, (n, 4))
    target = (np.sin(3 * x[:, 0]) + np.sin(2 * x[:, 1] + 3 * x[:, 2]) + 0.5 * np.sin(5 * x[:, 3])
              + 0.5 * np.sin(4 * x[:, 0] * x[:, 1]) + 0.2 * rng.standard_normal(n))
    return _split(x.astype(np.float32), _standardise(target), 200, 1213)


def sines_data():
    return _to_datasets(_sines())


def sines_model(input_shape, num_outputs):
    return nn.Sequential(nn.Linear(input_shape[0], 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, num_outputs))


# ---------------------------------------------------------------------------------------------------

PROBLEMS: dict[str, Problem] = {p.name: p for p in [
    Problem("blobs-mlp", "blobs_data", "blobs_model", 3, (), "classify",
            "16 features, 4 Gaussian classes whose means differ by 1 in every feature; MLP 64-64; defaults (SGD)"),
    Problem("digits-lenet", "digits_data", "digits_model", 8, (), "classify",
            "scikit-learn's 8x8 digits in [0, 1]; LeNet-style CNN; defaults (SGD)"),
    Problem("shapes-cnn-bn", "shapes_data", "shapes_model", 6, (), "classify",
            "noisy 16x16 square/cross/circle/diagonal outlines; CNN with BatchNorm; defaults (SGD momentum)"),
    Problem("seq-gru", "seq_data", "seq_model", 6, ("--optimizer", "adam"), "classify",
            "which of 3 patterns hides in a noisy 20x4 sequence; GRU(32) + linear; Adam at the default lr"),
    Problem("regress-unnormalised", "unnormalised_data", "unnormalised_model", 10,
            ("--optimizer", "sgd", "--momentum", "0", "--lr", "0.001"), "regress",
            "regression on 10 raw features scaled 1..100 (not normalised); MLP 64-64; plain SGD lr 0.001"),
    Problem("imbalanced-adamw", "imbalanced_data", "imbalanced_model", 8, ("--optimizer", "adamw"), "classify",
            "20 correlated features, 5 classes at 70/15/8/5/2 %; MLP 64-64; AdamW at the default lr"),
    Problem("textures-resnet", "textures_data", "textures_model", 6, (), "classify",
            "noisy 16x16 RGB stripes at 4 orientations; small ResNet (2 blocks, BatchNorm); defaults (SGD)"),
    Problem("moons-large", "moons_data", "moons_model", 4, ("--momentum", "0", "--batch-size", "64"), "classify",
            "20,000 two-moons samples lifted to 8 features; MLP 32-32; SGD without momentum, batch 64"),
    Problem("waves-conv1d", "waves_data", "waves_model", 8, ("--optimizer", "adam"), "classify",
            "noisy sine/square/sawtooth/noise-burst signals of length 64; 1-D CNN; Adam at the default lr"),
    Problem("tokens-transformer", "tokens_data", "tokens_model", 8, ("--optimizer", "adamw"), "classify",
            "which token is most frequent in a sequence of 12 (vocabulary 16); 1-layer pre-LN transformer d=32, "
            "2 heads; AdamW at the default lr"),
    Problem("pixels-unnormalised-cnn", "pixels_data", "pixels_model", 5, ("--grad-clip", "0.1"), "classify",
            "12x12 images with pixels 0..255 (not normalised), blob left/centre/right; CNN; SGD at the default lr, "
            "gradients clipped to 0.1 (without clipping one worker stays at chance)"),
    Problem("regress-sines-long", "sines_data", "sines_model", 30, ("--optimizer", "adam"), "regress",
            "regression of a sum of sines of 4 inputs, 1,000 samples, 30 epochs; MLP 64-64; Adam at the default lr"),
]}

# Fixed before any result was seen: rules are chosen on TUNING and checked on HELD_OUT.
TUNING = ["blobs-mlp", "digits-lenet", "shapes-cnn-bn", "seq-gru", "regress-unnormalised", "imbalanced-adamw"]
HELD_OUT = ["textures-resnet", "moons-large", "waves-conv1d", "tokens-transformer", "pixels-unnormalised-cnn",
            "regress-sines-long"]


def half_of(problem: str) -> str:
    return "tuning" if problem in TUNING else "held-out"


def target_variance(problem: str) -> float:
    """Variance of the test targets (population, as the test MSE averages over samples): R²'s denominator."""
    _, test = globals()[PROBLEMS[problem].data]()
    return float(torch.stack([test[i][1] for i in range(len(test))]).double().var(unbiased=False))
