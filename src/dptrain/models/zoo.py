"""Small built-in models: a classifier MLP, a regression MLP and a plain convolutional net."""

from __future__ import annotations

import math

from torch import nn


def mlp(input_shape: tuple[int, ...], num_outputs: int, *, hidden: tuple[int, ...] = (128, 64)) -> nn.Module:
    """Fully connected classifier on flattened samples of any shape; outputs logits."""
    return nn.Sequential(nn.Flatten(), *_dense_stack(math.prod(input_shape), hidden, num_outputs))


def mlp_regression(
    input_shape: tuple[int, ...],
    num_outputs: int,
    *,
    hidden: tuple[int, ...] = (128, 256, 512, 256, 128),
) -> nn.Module:
    """The reference regression MLP (8-128-256-512-256-128-1 for 8 features).

    The sigmoid output assumes targets scaled to [0, 1], as in the reference work.
    """
    return nn.Sequential(nn.Flatten(), *_dense_stack(math.prod(input_shape), hidden, num_outputs), nn.Sigmoid())


def cnn(input_shape: tuple[int, ...], num_outputs: int, *, width: int = 32) -> nn.Module:
    """Two conv stages (width, then 2*width channels) and a linear head, for (C, H, W) samples.

    Adaptive pooling to a 2x2 grid makes the head independent of the image size, so
    8x8 digits and 64x64 images use the same architecture.
    """
    channels = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2, ceil_mode=True),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 4, num_outputs),
    )


def _dense_stack(in_features: int, hidden: tuple[int, ...], out_features: int) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(in_features, size), nn.ReLU()]
        in_features = size
    layers.append(nn.Linear(in_features, out_features))
    return layers
