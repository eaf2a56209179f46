"""CIFAR-style ResNet (basic blocks, BatchNorm, depth 6n+2) for (C, H, W) samples of any size."""

from __future__ import annotations

from torch import Tensor, nn

from dptrain.errors import UserError

# Three stages of n basic blocks (two convs each) plus the stem conv and the head: 6n + 2 layers.
STAGE_STRIDES = (1, 2, 2)


def block_layout(width: int, blocks: int) -> list[tuple[int, int, int]]:
    """(in_channels, out_channels, stride) of every block; stages double the width (shared with nfnet)."""
    layout = []
    channels = width
    for stage, stride in enumerate(STAGE_STRIDES):
        out_channels = width * 2**stage
        for block in range(blocks):
            layout.append((channels, out_channels, stride if block == 0 else 1))
            channels = out_channels
    return layout


def blocks_per_stage(model_name: str, depth: int) -> int:
    """n for a 6n+2 network, or a UserError naming the bad depth (shared with nfnet)."""
    if depth < 8 or (depth - 2) % 6 != 0:
        raise UserError(
            f"option 'depth' for model '{model_name}' is {depth}, but it must be 6n+2 with n >= 1, "
            "for example 8, 14, 20, 32 or 56"
        )
    return (depth - 2) // 6


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 projection) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            # A projection rather than zero-padding keeps every block a plain module tree.
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, in_channels: int, num_outputs: int, blocks: int, width: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        layout = block_layout(width, blocks)
        self.blocks = nn.Sequential(*(BasicBlock(*shape) for shape in layout))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(layout[-1][1], num_outputs)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        out = self.pool(self.blocks(self.stem(x)))
        return self.head(out.flatten(1))


def resnet(input_shape: tuple[int, ...], num_outputs: int, *, depth: int = 8, width: int = 16) -> nn.Module:
    """ResNet-`depth` with stage widths width, 2*width, 4*width (ResNet-20 is depth=20, width=16)."""
    return ResNet(input_shape[0], num_outputs, blocks_per_stage("resnet", depth), width)
