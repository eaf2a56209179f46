"""Optimizers and learning-rate schedules by name, as TrainConfig describes them."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR


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


def lr_factor(step: int, *, steps_per_epoch: int, epochs: int, schedule: str = "constant",
              warmup_epochs: float = 0.0, step_epochs: int = 30, gamma: float = 0.1) -> float:
    """Multiplier of the base LR used for optimizer step `step` (counted from 0)."""
    total = max(1, steps_per_epoch * epochs)
    if schedule == "constant":
        factor = 1.0
    elif schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
    elif schedule == "step":
        factor = gamma ** ((step // steps_per_epoch) // step_epochs)
    else:
        raise ValueError(f"unknown LR schedule {schedule!r}")
    warmup = round(warmup_epochs * steps_per_epoch)
    if step < warmup:
        factor *= (step + 1) / warmup
    return factor


def build_schedule(optimizer: torch.optim.Optimizer, *, steps_per_epoch: int, epochs: int, schedule: str = "constant",
                   warmup_epochs: float = 0.0, step_epochs: int = 30, gamma: float = 0.1) -> LambdaLR:
    """A per-step scheduler: the trainer calls .step() after every optimizer step."""
    return LambdaLR(optimizer, lambda step: lr_factor(
        step, steps_per_epoch=steps_per_epoch, epochs=epochs, schedule=schedule,
        warmup_epochs=warmup_epochs, step_epochs=step_epochs, gamma=gamma))
