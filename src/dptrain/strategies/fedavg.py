"""fedavg: federated averaging — fixed private partitions, rounds of local epochs, weighted average.

Each worker is a client that keeps one partition (iid, contiguous or Dirichlet label skew)
for the whole run. A round is `local_epochs` epochs of local training by the clients sampled
for it (`clients_per_round`, a fraction, drawn from the seed); then the server average weighs
each participating client by its sample count (McMahan et al.'s FedAvg). Clients not sampled
sit the round out and receive the new global model.

The server step is the pipeline of dptrain.strategies.outer: the sample-weighted mean change of
the participating clients since the global model (compressed with `compression` fp16, bf16 or
int8 and error feedback, else one weighted all_reduce of the models), turned into the new
global model by the outer (server) optimizer `outer`: none (FedAvg), sgd (FedAvgM with lr 1,
momentum 0.9; Hsu et al. 2019), nesterov, adam (FedAdam; Reddi et al. 2021).

Client options:
- `proximal_mu` > 0 is FedProx (Li et al. 2020): after each backward pass a client adds
  mu * (w - w_global) to its gradient, w_global being the model it received at the start of the
  round; the local objective becomes F(w) + mu/2 |w - w_global|^2.
- `optimizer_state`: `keep` (each client's optimizer state carries over to its next round, the
  default), `reset` (fresh optimizer state every round: classic FedAvg) or `average` (the
  sample-weighted mean over the clients; needs every client in every round).

With a sharded model (`--shard hybrid`, dptrain.strategies.sharded) each replica group of S ranks is one
client: the clients are partitioned over the groups, a group's S ranks read its partition together (each
step's rows split over them, dptrain.data.sampler.partition_replica_plan), and the server step runs shard by
shard among the ranks holding the same shard (`across`), each weighted by its group's samples; FedProx's pull
and the outer optimizer's anchor are this rank's shards.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn

from dptrain.data.partition import PARTITIONERS, partition
from dptrain.data.sampler import EpochPlan, partition_plan
from dptrain.errors import UserError
from dptrain.runtime.distributed import DistContext
from dptrain.runtime.group import Group
from dptrain.runtime.sharded import local
from dptrain.strategies.base import Meeting, Strategy
from dptrain.strategies.collectives import broadcast_module
from dptrain.strategies.compression import COMPRESSIONS
from dptrain.strategies.outer import OPTIMIZER_STATES, Averager, OuterOptimizer, settle_optimizer_state
from dptrain.strategies.rules.fedavg import FedAvgRules
from dptrain.strategies.rules.outer import outer_settings
from dptrain.strategies.rules.sharding import AVERAGING_PLAIN, averaging_refused
from dptrain.strategies.sharded import Shardable


class FedAvg(Shardable, FedAvgRules, Strategy):
    """Federated averaging over fixed client partitions (a sharded model: one client per replica group)."""

    name = "fedavg"
    meeting = Meeting("epoch ends", averages_checked=True)

    def __init__(self, local_epochs: int = 1, partition: str = "iid", alpha: float = 0.5,
                 clients_per_round: float = 1.0, outer: str = "none", outer_lr: Optional[float] = None,
                 outer_momentum: Optional[float] = None, outer_betas: Optional[tuple[float, float]] = None,
                 outer_eps: Optional[float] = None, compression: str = "none", proximal_mu: float = 0.0,
                 optimizer_state: str = "keep") -> None:
        """The outer optimizer's settings not given come from dptrain.strategies.rules.outer, as on the CLI."""
        super().__init__()
        settings = outer_settings(outer, outer_lr, outer_momentum, outer_betas, outer_eps)
        outer_lr, outer_momentum = settings.outer_lr, settings.outer_momentum
        outer_betas, outer_eps = settings.outer_betas, settings.outer_eps
        if local_epochs < 1:
            raise ValueError("local_epochs must be at least 1")
        if partition not in PARTITIONERS:
            raise ValueError(f"partition must be one of {PARTITIONERS}, not {partition!r}")
        if not 0 < clients_per_round <= 1:
            raise ValueError("clients_per_round must be in (0, 1]")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
        if proximal_mu < 0:
            raise ValueError(f"proximal_mu must be at least 0, not {proximal_mu}")
        if optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATES}, not {optimizer_state!r}")
        if optimizer_state == "average" and clients_per_round < 1:
            raise ValueError("optimizer_state 'average' needs every client in every round (clients_per_round 1)")
        self.local_epochs, self.partition_kind, self.alpha = local_epochs, partition, alpha
        self.clients_per_round = clients_per_round
        self.outer, self.outer_lr, self.outer_momentum = outer, outer_lr, outer_momentum
        self.outer_betas, self.outer_eps = tuple(outer_betas), outer_eps
        self.compression, self.proximal_mu, self.optimizer_state = compression, proximal_mu, optimizer_state
        self.averager = Averager(OuterOptimizer(outer, outer_lr, outer_momentum, outer_betas, outer_eps),
                                 compression, keep_anchor=proximal_mu > 0)
        self.parts: list[np.ndarray] = []
        self.seed = 0
        self.rounds = 0
        self.participation: list[list[int]] = []
        self._diverged = False

    @classmethod
    def from_config(cls, config) -> "FedAvg":
        return cls(local_epochs=config.local_epochs, partition=config.partition, alpha=config.alpha,
                   clients_per_round=config.clients_per_round, outer=config.outer, outer_lr=config.outer_lr,
                   outer_momentum=config.outer_momentum, outer_betas=config.outer_betas,
                   outer_eps=config.outer_eps, compression=config.compression, proximal_mu=config.proximal_mu,
                   optimizer_state=config.optimizer_state)

    def partition(self, labels, world: int, seed: int) -> list[np.ndarray]:
        """Every rank computes the same partition from the labels (a DSTensor or array) and seed."""
        self.seed = seed
        values = np.asarray(labels.to_numpy() if hasattr(labels, "to_numpy") else labels)
        self.parts = partition(self.partition_kind, values, world, seed=seed, alpha=self.alpha)
        return self.parts

    def epoch_plan(self, ctx: DistContext, n_samples: int, labels, batch_size: int, seed: int,
                   shuffle: str, block_size=None) -> EpochPlan:
        """This client's partition for the whole run, permuted each epoch (`shuffle` does not apply); a sharded
        model's, its replica group's partition, each step's rows split over the group."""
        groups = self.replica_groups(ctx)
        if groups is not None:
            return groups.partition_plan(self.partition(labels(), groups.replicas, seed)[groups.index], batch_size,
                                         seed)
        return partition_plan(self.partition(labels(), ctx.world_size, seed)[ctx.rank], ctx.rank, batch_size, seed)

    def private_plan(self, ctx: DistContext, n_samples: int, batch_size: int, seed: int) -> EpochPlan:
        """This client's own data, all of it, permuted each epoch; the clients' sizes as each reports its own
        (the weights of the average)."""
        if self.shard_options is not None:
            raise UserError(f"each rank's own data (a --data factory taking rank) is refused with --shard "
                            f"{self.shard_options.shard}: the ranks of a replica group read one client's partition "
                            f"together; give one data set (--dataset or --data) or drop --shard")
        self.seed = seed
        self.parts = [np.arange(size) for size in ctx.group.gather_objects("each client's samples", n_samples)]
        return partition_plan(self.parts[ctx.rank], ctx.rank, batch_size, seed)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        super().setup(model, optimizer, ctx)
        train_model = model
        if self.shard_options is not None:
            train_model = self._shard_setup(model, optimizer, ctx, average_gradients=False)
        elif ctx.world_size > 1:
            self.comm_bytes += broadcast_module(model, group=self.ctx.group)
        self.averager.attach(model)
        return train_model

    def refused_with_sharding(self, shard: str) -> Optional[str]:
        """The settings a sharded fedavg refuses (dptrain.strategies.rules.sharding), given from Python."""
        return averaging_refused(self.name, shard, {key: getattr(self, key, plain)
                                                    for key, plain in AVERAGING_PLAIN.items()})

    def _clients(self) -> tuple[int, int, Group]:
        """(this rank's client, how many clients, the group the server step runs over): each rank, or with a
        sharded model each replica group, and then the ranks holding this rank's shard in every group."""
        if self.replicas is not None:
            return self.replicas.index, self.replicas.replicas, self.replicas.across
        return self.ctx.rank, self.ctx.world_size, self.ctx.group

    def clients_in_round(self, round_index: int) -> list[int]:
        """The clients sampled for a round: the same on every rank, reproducible from the seed."""
        world = self._clients()[1]
        count = max(1, round(self.clients_per_round * world))
        if count == world:
            return list(range(world))
        rng = np.random.default_rng([self.seed, round_index, 0xFEDA])
        return sorted(int(c) for c in rng.choice(world, size=count, replace=False))

    def trains_in_epoch(self, epoch: int) -> bool:
        return self._clients()[0] in self.clients_in_round(epoch // self.local_epochs)

    def after_backward(self, model: nn.Module) -> None:
        """FedProx: the gradient of mu/2 |w - w_global|^2 joins the loss's gradient."""
        if self.proximal_mu > 0:
            with torch.no_grad():
                for param, global_param in zip(self.model.parameters(), self.averager.anchor):
                    if not param.requires_grad:
                        continue
                    if param.grad is None:  # unused by this loss, still pulled towards the global model
                        param.grad = torch.zeros_like(param)
                    # (sharded: this rank's shards of the gradient and the parameter, the anchor's shard)
                    local(param.grad).add_(local(param) - global_param, alpha=self.proximal_mu)

    def after_step(self, step: int) -> None:
        self._diverged = True

    def end_epoch(self, epoch: int) -> bool:
        if (epoch + 1) % self.local_epochs == 0:
            self.aggregate(epoch // self.local_epochs)
            return True
        return False  # the same answer on every rank, sampled or not: evaluation is collective

    def averaging_events(self) -> int:
        return self.rounds

    def restores_average(self) -> bool:
        return not self.averager.uses_anchor

    def finish(self) -> nn.Module:
        if self._diverged:  # a last, partial round
            self.aggregate(self.rounds)
        return super().finish()

    def aggregate(self, round_index: int) -> None:
        """The server step: the sample-weighted mean change of the participating clients, then the
        outer optimizer; then the clients' optimizer state is kept, reset or averaged."""
        participants = self.clients_in_round(round_index)
        client, _, group = self._clients()
        weight = float(len(self.parts[client])) if client in participants else 0.0
        self.comm_bytes += self.averager.average(self.model, group, weight)
        self.comm_bytes += settle_optimizer_state(self.optimizer, self.optimizer_state, group, weight)
        self.rounds += 1
        self.participation.append(participants)
        self._diverged = False

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(rounds=self.rounds, participation=self.participation, diverged=self._diverged,
                     **self.averager.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.rounds, self.participation, self._diverged = state["rounds"], state["participation"], state["diverged"]
        self.averager.load_state_dict(state)

    def summary(self) -> dict:
        return {"rounds": self.rounds, "partition_sizes": [len(p) for p in self.parts],
                "participation": self.participation}

    def describe(self) -> dict:
        return {"name": self.name, "local_epochs": self.local_epochs, "partition": self.partition_kind,
                "alpha": self.alpha, "clients_per_round": self.clients_per_round, "outer": self.outer,
                "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                "outer_betas": list(self.outer_betas), "outer_eps": self.outer_eps,
                "compression": self.compression, "proximal_mu": self.proximal_mu,
                "optimizer_state": self.optimizer_state, **self.sharding()}
