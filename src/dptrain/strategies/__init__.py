"""Data-parallel strategies, one file each, all behind dptrain.strategies.base.Strategy, found by name in dptrain.registry."""

from dptrain import registry
from dptrain.strategies.allreduce import AllReduce
from dptrain.strategies.asynchronous import Async
from dptrain.strategies.base import Strategy
from dptrain.strategies.fedavg import FedAvg
from dptrain.strategies.sync import Sync


def build_strategy(config) -> Strategy:
    """The strategy a TrainConfig asks for, built by its registered class."""
    return registry.load("strategy", config.strategy).from_config(config)


__all__ = ["AllReduce", "Async", "FedAvg", "Strategy", "Sync", "build_strategy"]
