"""Data-parallel strategies, one file each, all behind dptrain.strategies.base.Strategy."""

from dptrain.strategies.allreduce import AllReduce
from dptrain.strategies.asynchronous import Async
from dptrain.strategies.fedavg import FedAvg
from dptrain.strategies.base import Strategy
from dptrain.strategies.sync import Sync


def build_strategy(config) -> Strategy:
    """The strategy a TrainConfig asks for."""
    classes = {"allreduce": AllReduce, "sync": Sync, "async": Async, "fedavg": FedAvg}
    if config.strategy in classes:
        return classes[config.strategy].from_config(config)
    raise ValueError(f"unknown strategy {config.strategy!r}")


__all__ = ["AllReduce", "Async", "FedAvg", "Strategy", "Sync", "build_strategy"]
