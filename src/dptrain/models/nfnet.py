"""Normaliser-free residual network (NF-ResNet style): no BatchNorm, so nothing to synchronise but weights.

The reference work trains an NFNet because weight averaging then covers the whole model
state. Signal propagation is kept in check without normalisation layers by:
- scaled weight-standardised convolutions (each filter has zero mean and unit fan-in variance),
- a gamma-scaled activation whose output has unit variance for unit-Gaussian input,
- residual branches that see their input divided by beta (its analytically expected std) and
  add their output scaled by alpha, with a learnable skip gain initialised to zero so every
  block starts as the identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dptrain.models.resnet import block_layout, blocks_per_stage

# Std of GELU(x) for x ~ N(0, 1) is 1 / GELU_GAMMA (value from Brock et al., 2021).
GELU_GAMMA = 1.7015043497085571
# How much variance each residual branch adds to the stream (NF-ResNet default).
ALPHA = 0.2


class ScaledGELU(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x) * GELU_GAMMA


class WSConv2d(nn.Conv2d):
    """Conv2d whose filters are standardised on every forward, with a learnable per-filter gain."""

    def __init__(self, *args, eps: float = 1e-4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1))
        self.eps = eps

    def standardized_weight(self) -> Tensor:
        fan_in = self.weight[0].numel()
        var, mean = torch.var_mean(self.weight, dim=(1, 2, 3), keepdim=True, unbiased=False)
        # Dividing by sqrt(fan_in * var) makes W x variance-preserving; eps guards constant filters.
        scale = torch.rsqrt(torch.clamp(var * fan_in, min=self.eps))
        return (self.weight - mean) * scale * self.gain

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.standardized_weight(), self.bias)


class NFBlock(nn.Module):
    """Pre-activation basic block: x + alpha * skip_gain * f(act(x) / beta)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, beta: float) -> None:
        super().__init__()
        self.beta = beta
        self.act = ScaledGELU()
        self.conv1 = WSConv2d(in_channels, out_channels, 3, stride=stride, padding=1)
        self.conv2 = WSConv2d(out_channels, out_channels, 3, padding=1)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = WSConv2d(in_channels, out_channels, 1, stride=stride)
        self.skip_gain = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        normalised = self.act(x) / self.beta
        # A transition block projects the normalised input, which resets the stream's variance.
        shortcut = x if self.shortcut is None else self.shortcut(normalised)
        branch = self.conv2(self.act(self.conv1(normalised)))
        return shortcut + branch * (ALPHA * self.skip_gain)


class NFNet(nn.Module):
    def __init__(self, in_channels: int, num_outputs: int, blocks: int, width: int) -> None:
        super().__init__()
        self.stem = WSConv2d(in_channels, width, 3, padding=1)
        layout = block_layout(width, blocks)
        layers = []
        expected_var = 1.0
        for block_in, block_out, stride in layout:
            layers.append(NFBlock(block_in, block_out, stride, beta=expected_var**0.5))
            transition = stride != 1 or block_in != block_out
            expected_var = (1.0 if transition else expected_var) + ALPHA**2
        self.blocks = nn.Sequential(*layers)
        self.act = ScaledGELU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(layout[-1][1], num_outputs)

    def forward(self, x: Tensor) -> Tensor:
        out = self.pool(self.act(self.blocks(self.stem(x))))
        return self.head(out.flatten(1))


def nfnet(input_shape: tuple[int, ...], num_outputs: int, *, depth: int = 8, width: int = 16) -> nn.Module:
    """NF-ResNet-`depth` (6n+2 layers, like resnet) with stage widths width, 2*width, 4*width."""
    return NFNet(input_shape[0], num_outputs, blocks_per_stage("nfnet", depth), width)
