"""Small built-in models: a classifier MLP, a regression MLP, a plain convolutional net and a 1-D one."""

from __future__ import annotations

import math

from torch import nn

from dptrain.errors import UserError


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


def cnn1d(input_shape: tuple[int, ...], num_outputs: int, *, channels: int = 25) -> nn.Module:
    """The baseline CNN of MNIST-1D (Greydanus 2020) for (C, L) sequences (a flat (L,) sample is one channel).

    Three convolutions of ``channels`` filters (kernel 5 stride 2 padding 1, then twice kernel 3
    stride 2 padding 1), each followed by a ReLU, then one linear layer on the flattened
    features: for MNIST-1D's 40 steps that is 25 x 5 = 125 features, 5,210 parameters in all.
    """
    in_channels, length = (1, input_shape[0]) if len(input_shape) == 1 else input_shape
    for kernel in (5, 3, 3):
        length = (length + 2 - kernel) // 2 + 1
    if length < 1:
        raise UserError(f"model 'cnn1d' needs sequences of at least 3 steps, but the samples have shape "
                        f"{tuple(input_shape)}")
    return nn.Sequential(
        nn.Unflatten(1, (1, input_shape[0])) if len(input_shape) == 1 else nn.Identity(),
        nn.Conv1d(in_channels, channels, 5, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv1d(channels, channels, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv1d(channels, channels, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(channels * length, num_outputs),
    )


def _dense_stack(in_features: int, hidden: tuple[int, ...], out_features: int) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(in_features, size), nn.ReLU()]
        in_features = size
    layers.append(nn.Linear(in_features, out_features))
    return layers
