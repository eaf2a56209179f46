"""Optimizers by name, as TrainConfig describes them (their learning rates and schedules: dptrain.lr_policy)."""

from __future__ import annotations

from typing import Iterable

import torch


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], *, lr: float, momentum: float = 0.0,
                    nesterov: bool = False, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0,
                               weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}")
