"""async across sharded replica groups: where its merge services are and who talks to which.

Unsharded, every worker merges into one service beside rank 0. With a sharded model (--shard hybrid), rank j of
each replica group holds shard j of the model, so there is one service per place j, on replica group 0's rank j,
holding shard j of the global model; rank j of every group merges its shards into it over a gloo group of the
ranks at place j (dptrain.strategies.asynchronous; docs/how-to/sharding.md, "async across replica groups").
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dptrain.runtime.distributed import DistContext
from dptrain.strategies.merge_service import SERVICE_GROUP_TIMEOUT


class ServicePlaces:
    """The merge services' places (a mixin of Async, before Shardable): `_index`, this worker's rank among those
    merging into its service, `_merging`, how many do, and `_service_group`, the group they talk over."""

    _global_copy = None  # sharded, in replica group 0: a copy sharded as the model, holding the global to evaluate

    def _shard_setup_global(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        """Shard the model inside its replica group; in group 0, whose ranks host the global model's shards, also a
        copy sharded alike that holds the global model to evaluate (`evaluation_target`)."""
        if self.replica_groups(ctx).index == 0 and ctx.joining is None:
            self._global_copy = copy.deepcopy(model)
        model = self._shard_setup(model, optimizer, ctx, average_gradients=False)
        if self._global_copy is not None:
            self._global_copy = self.replicas.shard_alike(self._global_copy, self._add_bytes)
        return model

    @property
    def _index(self) -> int:
        """This worker's rank in its service group (0: it hosts the service): its rank, or with a sharded model its
        replica group's index (rank j of group g merges into the service of place j, on group 0's rank j)."""
        return self.ctx.rank if self.replicas is None else self.replicas.index

    @property
    def _merging(self) -> int:
        """How many workers merge into one service: all of them, or one per replica group."""
        return self.ctx.world_size if self.replicas is None else self.replicas.replicas

    def _service_group(self, ctx: DistContext):
        """The ranks that talk to one merge service, on gloo and without a deadline (a worker may train for hours
        between merges): all of them, or with a sharded model the ranks of one place, one group per place, each
        made by every rank."""
        timeout = SERVICE_GROUP_TIMEOUT.total_seconds()
        if self.replicas is None:
            return ctx.group.subgroup(range(ctx.world_size), backend="gloo", timeout=timeout, name="the merge service")
        size = self.replicas.size
        groups = [ctx.group.subgroup(range(place, ctx.world_size, size), backend="gloo", timeout=timeout,
                                     name=f"the merge service of shard place {place}") for place in range(size)]
        return groups[self.replicas.place]
