"""Data-parallel strategies, one file each, all behind dptrain.strategies.base.Strategy, found by name in dptrain.registry.

The classes are imported when first used (they import torch), so that dptrain.strategies.rules, each
strategy's options and rules, stays light for config validation.
"""

from __future__ import annotations

import importlib
from typing import Any

from dptrain import registry

_CLASSES = {"AllReduce": "dptrain.strategies.allreduce", "Async": "dptrain.strategies.asynchronous",
            "FedAvg": "dptrain.strategies.fedavg", "Strategy": "dptrain.strategies.base",
            "Sync": "dptrain.strategies.sync"}


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_strategy(config) -> "Strategy":
    """The strategy a TrainConfig asks for, built by its registered class."""
    return registry.load("strategy", config.strategy).from_config(config)


__all__ = ["AllReduce", "Async", "FedAvg", "Strategy", "Sync", "build_strategy"]
