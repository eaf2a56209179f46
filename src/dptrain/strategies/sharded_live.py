"""Live membership of sharded replica groups (--shard hybrid with --min-workers, counted in replica groups).

A replica group holds one copy of the model, sharded over its S ranks: no rank of it holds another's shard, so a
group that loses a rank has lost its copy. The survivors' agreement (dptrain.runtime.membership.regroup, `unit`
S) keeps whole groups only; the lost group's other ranks leave (GroupLost, exit code 75, one line naming the rank
their group lost), and the other groups go on as a new generation, in the order they had: rank j of each group
stays rank j of it, with its own shards.

`regroup_replicas` then makes the groups across anew (rank j of each surviving group; the old ones held the lost
group's rank j) and points what communicates across at them: allreduce's gradient all-reduce (HSDP, with the
mean now over S x the groups left) and sync's average. Inside each surviving group nothing was lost: FSDP stays
on that group's own process group, whose members are all alive and have made the same collectives in it (a
failure across the groups is held until the backward is over, dptrain.runtime.sharded.AcrossReduce).

Which rows: the survivors go back to the start of the epoch the failure happened in (each rank's shards and
optimizer shards as they were then) and redo it, planned over the groups left (replica_plan), so every row is
read once in each epoch, that one included; what was trained of it before the failure is dropped.

A replacement group (--replace-workers: the launcher starts S ranks in place of a lost group) joins at an epoch end
as the last replica group: its ranks shard the model over a process group of their own, made over the store
(ShardedReplicas.joined), every rank makes the groups across anew here, and rank j of the first group hands rank j
of the new one its shards over them (dptrain.train.live), never a whole model, never a file.
"""

from __future__ import annotations

from torch import nn

from dptrain.errors import UserError
from dptrain.runtime.distributed import DistContext
from dptrain.runtime.group import PeerFailure
from dptrain.runtime.sharded import divide_gradients
from dptrain.strategies.rules.sharding import live_strategy_refused


def refuse_live(options, strategy: str) -> None:
    """--min-workers with `options` (a ShardOptions) under `strategy` (its name): refused with --shard full (one
    replica group: no second copy), and with the strategies not built to go on without a replica group."""
    refused = live_strategy_refused(options.shard, strategy)
    if refused is not None:
        raise UserError(refused)


def regroup_replicas(replicas, ctx: DistContext, model: nn.Module) -> None:
    """The replica groups of `replicas` (a ShardedReplicas) in `ctx.group`, after a lost group or a joined one: each
    rank's group as it was (checked), the groups across made anew, HSDP's mean over the ranks there are."""
    size, members, rank = replicas.size, list(ctx.group.members), ctx.rank
    first = rank - rank % size
    block = members[first:first + size]
    inside = replicas.inside
    if list(inside.members) != block:  # regroup keeps whole groups, in their order: this cannot be
        raise RuntimeError(f"rank {members[rank]}: its replica group was ranks {inside.members} of the job, and the "
                           f"survivors' group places it with ranks {block}")
    inside.generation = ctx.group.generation  # (a watched collective in it gives up on this generation's failure)
    replicas.replicas = ctx.world_size // size
    if replicas.replicas == 1 and replicas.reduce_across is None:
        raise PeerFailure(f"rank {members[rank]}: one replica group is left (ranks {', '.join(map(str, block))}), "
                          "and sync has no other group to average with")
    stripes = [list(range(place, ctx.world_size, size)) for place in range(size)]
    replicas.across = ctx.group.split(stripes, name="the replica groups") if replicas.replicas > 1 else None
    if replicas.reduce_across is not None:
        replicas.reduce_across.group = replicas.across
        divide_gradients(model, size * replicas.replicas)
