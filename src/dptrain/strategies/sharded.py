"""Sharded replica groups: the ranks as groups of S, the model sharded inside each, the strategy across them.

With `--shard full` all W ranks are one replica group; with `--shard hybrid` ranks [gS, (g+1)S) form replica
group g (S = --shard-size, default the ranks of one node). Inside a group the model is sharded with FSDP2
(dptrain.runtime.sharded): each rank holds 1/S of the parameters, gradients and optimizer state. Across the
groups, rank j of each group holds the same shard, and the strategy communicates among those ranks
(`across`, a Group): allreduce all-reduces each step's reduce-scattered gradient shard over it (HSDP),
sync averages the parameter shards over it every period, shard by shard, never gathering a whole model (an outer
step, `--outer`, acts on the shards too: its anchor and momentum are this rank's shards), and fedavg makes each
replica group one client, its average weighted by the group's samples, shard by shard over `across` too.

Which rows a rank reads: replica group g reads what unsharded worker g of W/S would read with S times the
batch, each step's rows split over the group's ranks (dptrain.data.sampler.replica_plan). So a sharded run
of R replica groups computes what an unsharded run of R workers with S x --batch-size does (in float
rounding), and every row is read once an epoch. Under fedavg, replica group g reads client g's fixed partition
so (dptrain.data.sampler.partition_replica_plan): what unsharded client g reads with S times the batch.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from dptrain.data.sampler import EpochPlan, partition_replica_plan, replica_plan
from dptrain.errors import UserError
from dptrain.runtime.distributed import DistContext
from dptrain.runtime.env import detect
from dptrain.runtime.group import Group
from dptrain.runtime.sharded import (AcrossReduce, LocalOptimizerShards, LocalShards, fsdp_settings, shard_model,
                                     units_of)
from dptrain.strategies.collectives import broadcast_module
from dptrain.strategies.rules.sharding import DEFAULT_UNIT_SHARE, REFUSED_LINE, ShardOptions, one_group_refused
from dptrain.strategies.sharded_live import refuse_live, regroup_replicas


class ShardedReplicas:
    """This rank's replica group (`inside`, S ranks) and its peers in the other groups (`across`, None with one
    group); `shard` shards the model inside the group."""

    reduce_across: Optional[AcrossReduce] = None  # the gradient shards' all-reduce across the groups (HSDP)

    def __init__(self, options: ShardOptions, ctx: DistContext) -> None:
        world = ctx.world_size
        self.options = options
        self.size = options.size(world, detect().local_world_size)
        self.replicas = world // self.size
        size = self.size
        self.index, self.place = ctx.rank // size, ctx.rank % size  # this rank's replica group, its place in it
        if self.replicas == 1:
            self.inside = ctx.group
        else:
            blocks = [list(range(first, first + size)) for first in range(0, world, size)]
            self.inside = ctx.group.split(blocks, name="this rank's replica group")
        stripes = [list(range(place, world, size)) for place in range(size)]
        self.across = ctx.group.split(stripes, name="the replica groups") if self.replicas > 1 else None

    @classmethod
    def joined(cls, options: ShardOptions, ctx: DistContext) -> "ShardedReplicas":
        """The replica group of ranks that joined a running run together (replacements for a lost group), `ctx` the
        run's new group: its own process group over the store, made by its ranks only (the other groups keep
        theirs, FSDP on them); the groups across are made by every rank as the group enters
        (dptrain.strategies.sharded_live.regroup_replicas)."""
        replicas = cls.__new__(cls)
        replicas.options, replicas.size = options, options.size(ctx.world_size, detect().local_world_size)
        replicas.replicas = ctx.world_size // replicas.size
        replicas.index, replicas.place = divmod(ctx.rank, replicas.size)
        group, first = ctx.group, ctx.rank - replicas.place
        block = group.members[first:first + replicas.size]
        replicas.inside = Group.over_store(group.store, group.members[ctx.rank], block,
                                           group.generation, device=ctx.device, backend=group.backend,
                                           timeout=group.timeout, heartbeat=group.heartbeat,
                                           key=f"/joined{replicas.index}", name="this rank's replica group")
        replicas.inside.watch, replicas.across = group.watch, None
        return replicas

    def shard(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext,
              count: Callable[[int], None], average_gradients: bool, live: bool = False,
              equal: bool = False) -> nn.Module:
        """Rank 0's model on every rank (counted, as DDP's constructor broadcast is; not when `equal`: a group that
        joined takes its shards' values from a live group next), then sharded inside the group; with
        `average_gradients`, each step's gradient shards are all-reduced across the groups too (`live`: a failure
        there is raised after the backward, dptrain.runtime.sharded.AcrossReduce)."""
        if not equal:
            count(broadcast_module(model, group=ctx.group))
        options = self.options
        if options.shard_offload and ctx.device.type != "cuda":
            raise UserError(f"--shard-offload moves the shards from a GPU to the CPU, and this rank trains on "
                            f"{ctx.device}; drop --shard-offload or train on GPUs")
        return shard_model(model, optimizer, self.inside, count, unit=options.shard_unit, share=DEFAULT_UNIT_SHARE,
                           across=self._reduce_across(count, live) if average_gradients else None,
                           settings=fsdp_settings(options.shard_precision, options.shard_offload),
                           recompute=options.shard_checkpoint)

    def shard_alike(self, module: nn.Module, count: Callable[[int], None]) -> nn.Module:
        """Shard a copy of the model (one that is only evaluated, no optimizer: streaming's global model) in place
        as `shard` shards the model, so that each rank holds the same part of both; its values are the caller's
        to set, shard by shard."""
        options = self.options
        return shard_model(module, None, self.inside, count, unit=options.shard_unit, share=DEFAULT_UNIT_SHARE,
                           settings=fsdp_settings(options.shard_precision, options.shard_offload))

    def _reduce_across(self, count: Callable[[int], None], live: bool) -> AcrossReduce:
        self.reduce_across = AcrossReduce(self.across, count, hold_failures=live)
        return self.reduce_across

    def plan(self, ctx: DistContext, n_samples: int, batch_size: int, seed: int, shuffle: str,
             block_size: Optional[int]) -> EpochPlan:
        return replica_plan(n_samples, ctx.rank, ctx.world_size, self.size, batch_size, seed, shuffle, block_size)

    def partition_plan(self, partition, batch_size: int, seed: int) -> EpochPlan:
        """This rank's part of its replica group's fixed `partition` (fedavg: the group is one client)."""
        return partition_replica_plan(partition, self.index, self.size, self.place, batch_size, seed)

    def describe(self) -> dict:
        options = self.options
        return {"shard": options.shard, "shard_size": self.size, "replica_groups": self.replicas,
                "shard_unit": options.shard_unit, "shard_precision": options.shard_precision,
                "shard_offload": options.shard_offload, "shard_checkpoint": options.shard_checkpoint}


class Shardable:
    """A strategy that runs across sharded replica groups (a mixin before Strategy): `shard_as` before setup;
    then `replicas` is set at setup, the epoch plan is the replica groups', and a checkpoint holds this rank's
    shards."""

    shard_options: Optional[ShardOptions] = None
    replicas: Optional[ShardedReplicas] = None
    gradients_across = False  # whether each step's gradient shards are all-reduced across the groups (HSDP)

    @classmethod
    def check_before_spawn(cls, config, model: nn.Module) -> None:
        """A --shard-unit the model has no module of, said before any worker starts (and nothing is written)."""
        if getattr(config, "shard", "none") != "none":
            units_of(model, config.shard_unit, DEFAULT_UNIT_SHARE)
        super().check_before_spawn(config, model)

    def shard_as(self, options: Optional[ShardOptions]) -> None:
        self.shard_options = options if options is not None and options.sharded else None
        refused = self.refused_with_sharding(options.shard) if self.shard_options is not None else None
        if refused is not None:
            raise UserError(f"--shard {options.shard} is refused with {refused}: {REFUSED_LINE}")

    def refused_with_sharding(self, shard: str) -> Optional[str]:
        """What of this strategy's settings `--shard shard` refuses (as the flag and value), or None."""
        return None

    def replica_groups(self, ctx: DistContext) -> Optional[ShardedReplicas]:
        """The replica groups (made at the first call, on every rank), or None when the model is not sharded, or not
        yet: a worker joining a running run is sharded when its group is admitted (`join_sharded`)."""
        if self.replicas is None and self.shard_options is not None and ctx.joining is None:
            self.replicas = ShardedReplicas(self.shard_options, ctx)
        return self.replicas

    def _shard_setup(self, model: nn.Module, optimizer, ctx: DistContext, average_gradients: bool) -> nn.Module:
        """Set up sharded replica groups and shard `model` (every rank of the job calls it); a worker joining a
        running run trains nothing before its group is admitted, and is sharded then (`join_sharded`)."""
        if ctx.joining is not None:
            return model
        self.replica_groups(ctx)  # (epoch_plan may have made them already, on every rank)
        if self.replicas.replicas == 1 and not average_gradients:
            raise UserError(one_group_refused(self.shard_options.shard, self.name, ctx.world_size))
        return self.replicas.shard(model, optimizer, ctx, self._add_bytes, average_gradients, live=self.live)

    def join_sharded(self, ctx: DistContext) -> None:
        """A worker admitted with the other ranks of a replica group that joins (`ctx`: the run's new group): its
        group's process group made, the model and optimizer sharded over it as every group's are; the values of its
        shards come next, from its peer in a live group (dptrain.train.live), which is never a whole model."""
        self.replicas = ShardedReplicas.joined(self.shard_options, ctx)
        self.replicas.shard(self.model, self.optimizer, ctx, self._add_bytes, self.gradients_across, live=self.live,
                            equal=True)

    def epoch_plan(self, ctx, n_samples, labels, batch_size, seed, shuffle, block_size=None) -> EpochPlan:
        if self.replica_groups(ctx) is None:  # (planned before setup: the groups are made here first)
            return super().epoch_plan(ctx, n_samples, labels, batch_size, seed, shuffle, block_size)
        return self.replicas.plan(ctx, n_samples, batch_size, seed, shuffle, block_size)

    def checkpoint_parts(self, parts: dict) -> dict:
        if self.shard_options is None:
            return parts
        return {**parts, "model": LocalShards(parts["model"]), "optimizer": LocalOptimizerShards(parts["optimizer"])}

    def enable_live(self, min_workers: int) -> None:
        """--min-workers counts replica groups with --shard hybrid; refused with --shard full (one group: no second
        copy of its shards)."""
        if self.shard_options is not None:
            refuse_live(self.shard_options, self.name)
        super().enable_live(min_workers)

    @property
    def live_unit(self) -> int:
        """The ranks lost together: a replica group's (its shards have no second copy)."""
        return self.replicas.size if self.replicas is not None else 1

    def rebind(self, ctx: DistContext) -> nn.Module:
        """After a replica group was lost: the survivors' groups again (dptrain.strategies.sharded_live)."""
        if self.replicas is not None:
            regroup_replicas(self.replicas, ctx, self.model)
        return super().rebind(ctx)

    def after_backward(self, model: nn.Module) -> None:
        """A gradient all-reduce across the groups that failed in this backward (live membership), raised now."""
        if self.replicas is not None and self.replicas.reduce_across is not None:
            self.replicas.reduce_across.raise_failure()
        super().after_backward(model)

    def sharding(self) -> dict:
        """The sharding for describe() (nothing when the model is not sharded)."""
        return self.replicas.describe() if self.replicas is not None else {}
