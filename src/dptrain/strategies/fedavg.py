"""fedavg: federated averaging — fixed private partitions, rounds of local epochs, weighted average.

Each worker is a client that keeps one partition (iid, contiguous or Dirichlet label skew)
for the whole run. A round is `local_epochs` epochs of local training by the clients sampled
for it (`clients_per_round`, a fraction, drawn from the seed); then the server average weighs
each participating client by its sample count (McMahan et al.'s FedAvg). Clients not sampled
sit the round out and receive the new global model.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dptrain.data.partition import PARTITIONERS, partition
from dptrain.data.sampler import EpochPlan, partition_plan
from dptrain.runtime.distributed import DistContext
from dptrain.strategies.base import Strategy
from dptrain.strategies.collectives import broadcast_module, weighted_average_module


class FedAvg(Strategy):
    """Federated averaging over fixed client partitions."""

    name = "fedavg"

    def __init__(self, local_epochs: int = 1, partition: str = "iid", alpha: float = 0.5,
                 clients_per_round: float = 1.0) -> None:
        super().__init__()
        if local_epochs < 1:
            raise ValueError("local_epochs must be at least 1")
        if partition not in PARTITIONERS:
            raise ValueError(f"partition must be one of {PARTITIONERS}, not {partition!r}")
        if not 0 < clients_per_round <= 1:
            raise ValueError("clients_per_round must be in (0, 1]")
        self.local_epochs, self.partition_kind, self.alpha = local_epochs, partition, alpha
        self.clients_per_round = clients_per_round
        self.parts: list[np.ndarray] = []
        self.seed = 0
        self.rounds = 0
        self.participation: list[list[int]] = []
        self._diverged = False

    @classmethod
    def from_config(cls, config) -> "FedAvg":
        return cls(local_epochs=config.local_epochs, partition=config.partition, alpha=config.alpha,
                   clients_per_round=config.clients_per_round)

    def partition(self, labels, world: int, seed: int) -> list[np.ndarray]:
        """Every rank computes the same partition from the labels (a DSTensor or array) and seed."""
        self.seed = seed
        values = np.asarray(labels.to_numpy() if hasattr(labels, "to_numpy") else labels)
        self.parts = partition(self.partition_kind, values, world, seed=seed, alpha=self.alpha)
        return self.parts

    def epoch_plan(self, ctx: DistContext, n_samples: int, labels, batch_size: int, seed: int,
                   shuffle: str, block_size=None) -> EpochPlan:
        """This client's partition for the whole run, permuted each epoch (`shuffle` does not apply)."""
        return partition_plan(self.partition(labels(), ctx.world_size, seed)[ctx.rank], ctx.rank, batch_size, seed)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        super().setup(model, optimizer, ctx)
        if ctx.world_size > 1:
            self.comm_bytes += broadcast_module(model)
        return model

    def clients_in_round(self, round_index: int) -> list[int]:
        """The clients sampled for a round: the same on every rank, reproducible from the seed."""
        world = self.ctx.world_size
        count = max(1, round(self.clients_per_round * world))
        if count == world:
            return list(range(world))
        rng = np.random.default_rng([self.seed, round_index, 0xFEDA])
        return sorted(int(c) for c in rng.choice(world, size=count, replace=False))

    def trains_in_epoch(self, epoch: int) -> bool:
        return self.ctx.rank in self.clients_in_round(epoch // self.local_epochs)

    def after_step(self, step: int) -> None:
        self._diverged = True

    def end_epoch(self, epoch: int) -> bool:
        if (epoch + 1) % self.local_epochs == 0:
            self.aggregate(epoch // self.local_epochs)
            return True
        return False  # the same answer on every rank, sampled or not: evaluation is collective

    def finish(self) -> nn.Module:
        if self._diverged:  # a last, partial round
            self.aggregate(self.rounds)
        return super().finish()

    def aggregate(self, round_index: int) -> None:
        """The server step: the sample-weighted mean of the participating clients' models."""
        participants = self.clients_in_round(round_index)
        weight = float(len(self.parts[self.ctx.rank])) if self.ctx.rank in participants else 0.0
        if self.ctx.world_size > 1:
            self.comm_bytes += weighted_average_module(self.model, weight)
        self.rounds += 1
        self.participation.append(participants)
        self._diverged = False

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(rounds=self.rounds, participation=self.participation, diverged=self._diverged)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.rounds, self.participation, self._diverged = state["rounds"], state["participation"], state["diverged"]

    def summary(self) -> dict:
        return {"rounds": self.rounds, "partition_sizes": [len(p) for p in self.parts],
                "participation": self.participation}

    def describe(self) -> dict:
        return {"name": self.name, "local_epochs": self.local_epochs, "partition": self.partition_kind,
                "alpha": self.alpha, "clients_per_round": self.clients_per_round}
