"""Data-parallel strategies, one file each, all behind dptrain.strategies.base.Strategy."""

from dptrain.strategies.allreduce import AllReduce
from dptrain.strategies.base import Strategy
from dptrain.strategies.sync import Sync

STRATEGIES = {"allreduce": AllReduce, "sync": Sync}


def build_strategy(config) -> Strategy:
    """The strategy a TrainConfig asks for."""
    if config.strategy == "allreduce":
        return AllReduce(compression=config.compression)
    if config.strategy == "sync":
        return Sync(every=config.sync_every, every_steps=config.sync_every_steps,
                    optimizer_state=config.optimizer_state, outer=config.outer,
                    outer_lr=config.outer_lr, outer_momentum=config.outer_momentum)
    raise ValueError(f"unknown strategy {config.strategy!r}")


__all__ = ["AllReduce", "Strategy", "Sync", "STRATEGIES", "build_strategy"]
