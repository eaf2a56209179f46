"""Data-parallel strategies, one file each, all behind dptrain.strategies.base.Strategy."""

from dptrain.strategies.allreduce import AllReduce
from dptrain.strategies.asynchronous import Async
from dptrain.strategies.fedavg import FedAvg
from dptrain.strategies.base import Strategy
from dptrain.strategies.sync import Sync


def build_strategy(config) -> Strategy:
    """The strategy a TrainConfig asks for."""
    if config.strategy == "allreduce":
        return AllReduce(compression=config.compression)
    if config.strategy == "sync":
        return Sync(every=config.sync_every, every_steps=config.sync_every_steps,
                    optimizer_state=config.optimizer_state, outer=config.outer,
                    outer_lr=config.outer_lr, outer_momentum=config.outer_momentum)
    if config.strategy == "async":
        return Async(every=config.sync_every, merge=config.merge, max_staleness=config.max_staleness)
    if config.strategy == "fedavg":
        return FedAvg(local_epochs=config.local_epochs, partition=config.partition, alpha=config.alpha,
                      clients_per_round=config.clients_per_round)
    raise ValueError(f"unknown strategy {config.strategy!r}")


__all__ = ["AllReduce", "Async", "FedAvg", "Strategy", "Sync", "build_strategy"]
