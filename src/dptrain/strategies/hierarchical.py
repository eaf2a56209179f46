"""hierarchical: gradients all-reduced every step inside a node, weights averaged across nodes every period.

Ranks on one node share a fast link (shared memory, NVLink, the host's loopback); nodes share a
slow one (the cluster network). Inside each node the ranks train as one DistributedDataParallel
group (`process_group` = the node's Group, from `Group.split`): their
gradients are averaged every step over the fast link, so the replicas of one node stay equal.
Across nodes nothing moves until the end of a period (every `every` epochs, or every
`every_steps` steps), when the nodes average their weights, as `sync` does between ranks.

Who takes part in the average over the slow link: **the node leaders only** (the lowest rank of
each node). After a step every rank of a node holds the same parameters, so averaging over all
ranks would only repeat each node's model L times. The leaders all-reduce the model among
themselves (each leader hands the model, M bytes, to one all-reduce among N nodes; a ring moves
2(N-1)/N x M through each node's link), then each leader broadcasts the result to its node over
the fast link (M bytes, intra-node). An all-reduce among all W = N x L ranks would put a ring of
W ranks on the slow links: 2(W-1)/W x M per node link with contiguous ranks, and more when the
ranks of a node are not neighbours in the ring, so leaders-only moves the fewest bytes over the
slow link. (Splitting the model into L shards, one all-reduce per local rank across nodes, moves
the same total through each node's link, in L streams.) Afterwards every rank holds the
identical global model: the mean of the node models, weighted by their ranks when nodes differ
in size (so it is always the mean over ranks, the `sync` average).

Parameters and floating buffers are averaged, integer buffers take the max (BatchNorm's
counters), as in `sync`. Optimizer state stays per rank (equal inside a node, as DDP keeps it).

Which ranks share a node (`assign_nodes`):
  1. `ranks_per_node` (--ranks-per-node N), when given: ranks [kN, (k+1)N) form node k.
  2. Otherwise every rank tells its host name and the local world size its launcher set
     (dptrain.runtime.env: LOCAL_WORLD_SIZE under torchrun and dptrain's launcher,
     SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE under srun, OMPI_COMM_WORLD_LOCAL_SIZE
     under mpirun, MPI_LOCALNRANKS under MPICH/Intel MPI): ranks with the same
     host name form a node, and a host whose launcher says fewer local ranks than it holds (two
     torchrun agents on one machine) is split into blocks of that size in rank order.

Bytes: `intra_node_bytes` counts what this rank hands to its node's collectives (the DDP
start-up broadcast, every gradient bucket, DDP's buffer broadcast per step, the broadcast after
an average), `inter_node_bytes` what a leader hands to the leaders' collectives (the start-up
broadcast of rank 0's model, every average); `comm_bytes` is their sum. With one node this is
`allreduce` (same weights, same bytes); with one rank per node it is `sync`.
"""

from __future__ import annotations

import socket
from typing import Optional, Sequence

import torch
from torch import nn

from dptrain.errors import UserError
from dptrain.runtime.distributed import DistContext
from dptrain.runtime.env import detect
from dptrain.runtime.group import Group
from dptrain.strategies.base import Strategy, check_period
from dptrain.strategies.collectives import (average_module, broadcast_module, module_state, tensor_bytes,
                                            weighted_average_module)
from dptrain.strategies.rules.hierarchical import HierarchicalRules


def check_ranks_per_node(ranks_per_node: Optional[int], world: int) -> None:
    """One sentence (UserError) when --ranks-per-node cannot split `world` ranks into equal nodes."""
    if ranks_per_node is None:
        return
    if ranks_per_node < 1 or world % ranks_per_node:
        divisors = [n for n in range(1, world + 1) if world % n == 0]
        ranks = f"{world} ranks" if world != 1 else "1 rank"
        raise UserError(f"--ranks-per-node {ranks_per_node} does not divide the {ranks} into equal nodes; "
                        f"use one of {', '.join(map(str, divisors))}")


def assign_nodes(world: int, ranks_per_node: Optional[int] = None, hosts: Optional[Sequence[str]] = None,
                 local_sizes: Optional[Sequence[Optional[int]]] = None) -> list[list[int]]:
    """The ranks of each node, nodes ordered by their lowest rank (see the module docstring for the rules).

    `hosts[r]` is rank r's host name, `local_sizes[r]` the local world size its launcher set (None: none set)."""
    if ranks_per_node is not None:
        check_ranks_per_node(ranks_per_node, world)
        return [list(range(first, first + ranks_per_node)) for first in range(0, world, ranks_per_node)]
    hosts = list(hosts) if hosts is not None else ["localhost"] * world
    local_sizes = list(local_sizes) if local_sizes is not None else [None] * world
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    nodes = []
    for ranks in by_host.values():
        sizes = {local_sizes[rank] for rank in ranks}
        size = sizes.pop() if len(sizes) == 1 else None
        if size is not None and 1 <= size < len(ranks) and len(ranks) % size == 0:
            nodes += [ranks[first:first + size] for first in range(0, len(ranks), size)]
        else:
            nodes.append(ranks)
    return sorted(nodes)


class Hierarchical(HierarchicalRules, Strategy):
    """DDP inside each node every step; the node leaders average the weights every period."""

    name = "hierarchical"

    def __init__(self, every: int = 1, every_steps: Optional[int] = None, ranks_per_node: Optional[int] = None,
                 bucket_cap_mb: float = 25.0) -> None:
        super().__init__()
        check_period(every, every_steps)
        if ranks_per_node is not None and ranks_per_node < 1:
            raise ValueError("ranks_per_node must be at least 1")
        self.every, self.every_steps, self.ranks_per_node = every, every_steps, ranks_per_node
        self.bucket_cap_mb = bucket_cap_mb
        self.intra_node_bytes = 0
        self.inter_node_bytes = 0
        self.averages = 0
        self.nodes: list[list[int]] = []
        self._node: list[int] = []  # this rank's node
        self._node_group: Optional[Group] = None  # None: the whole job (one node)
        self._leader_group: Optional[Group] = None  # None: the whole job (one rank per node)
        self._buffer_bytes = 0
        self._diverged = False  # the nodes' models differ since the last average
        self._node_of: dict[int, int] = {}  # rank of the job -> its node (an index), kept across membership changes
        self._per_worker: Optional[list[tuple[int, int]]] = None

    @classmethod
    def from_config(cls, config) -> "Hierarchical":
        return cls(every=config.sync_every, every_steps=config.sync_every_steps,
                   ranks_per_node=config.ranks_per_node)

    @classmethod
    def check_before_spawn(cls, config, model: nn.Module) -> None:
        """--ranks-per-node must split the local workers into equal nodes (other launchers: checked at setup)."""
        check_ranks_per_node(config.ranks_per_node, config.workers)

    # -- layout --------------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return bool(self._node) and self.ctx is not None and self.ctx.rank == self._node[0]

    @property
    def node_group(self) -> Group:
        """The ranks of this rank's node (the leader is rank 0 in it)."""
        return self._node_group or self.ctx.group

    @property
    def leader_group(self) -> Group:
        """The node leaders (rank 0 of the job is rank 0 in it); meaningful on leaders only."""
        return self._leader_group or self.ctx.group

    def _find_nodes(self, ctx: DistContext) -> list[list[int]]:
        if self.ranks_per_node is not None:
            return assign_nodes(ctx.world_size, self.ranks_per_node)
        env = detect()
        mine = (socket.gethostname(), env.local_world_size if env.launched else None)
        gathered = ctx.group.gather_objects("node membership", mine)
        return assign_nodes(ctx.world_size, None, [host for host, _ in gathered], [size for _, size in gathered])

    def _count(self, intra: int = 0, inter: int = 0) -> None:
        self.intra_node_bytes += intra
        self.inter_node_bytes += inter
        self.comm_bytes = self.intra_node_bytes + self.inter_node_bytes

    # -- hooks ---------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        super().setup(model, optimizer, ctx)
        if ctx.world_size == 1:
            self.nodes, self._node = [[0]], [0]
            return model
        self._make_groups(ctx, self._find_nodes(ctx))
        if self.is_leader and len(self.nodes) > 1:  # rank 0's model to every node, over the slow link
            self._count(inter=broadcast_module(model, src=0, group=self.leader_group))
        return self._wrap(init_sync=True)

    def _make_groups(self, ctx: DistContext, nodes: list[list[int]]) -> None:
        """The node groups and the leaders' group for the layout `nodes` (ranks of `ctx.group`); the ones they
        replace (a membership change) are closed first, their connections dropped (they were made from a group
        of the generation before, which is gone: nothing is sent on them again)."""
        for old in (self._node_group, self._leader_group):
            if old is not None:
                old.close()
        self.nodes = nodes
        self._node = next(node for node in nodes if ctx.rank in node)
        self._node_of = {ctx.group.members[rank]: index for index, node in enumerate(nodes) for rank in node}
        self._node_group = self._leader_group = None
        # Every rank creates every group, in the same order (torch.distributed requires it).
        if len(nodes) > 1 and max(map(len, nodes)) > 1:
            self._node_group = ctx.group.split(nodes, name="this node")
        leaders = [node[0] for node in nodes]
        if 1 < len(leaders) < ctx.world_size:
            self._leader_group = ctx.group.subgroup(leaders, name="the node leaders")

    def _wrap(self, init_sync: bool) -> nn.Module:
        """The model under DDP on this rank's node (alone on its node: the model itself)."""
        self._buffer_bytes = 0
        if len(self._node) == 1:
            return self.model
        if init_sync:
            floating, integer = module_state(self.model)
            # DDP's constructor broadcasts the leader's parameters and buffers to its node; DDP
            # re-broadcasts the buffers (BatchNorm statistics) from the leader before every forward.
            self._count(intra=tensor_bytes(floating + integer))
        self._buffer_bytes = tensor_bytes(self.model.buffers())
        ddp = self.node_group.data_parallel(self.model, init_sync=init_sync, bucket_cap_mb=self.bucket_cap_mb)
        hook = self.gradient_hook(self.node_group, lambda sent: self._count(intra=sent))
        ddp.register_comm_hook(state=None, hook=hook)
        return ddp

    def rebind(self, ctx: DistContext) -> nn.Module:
        """After a membership change: each worker left stays on its node (a node whose ranks were all lost is
        gone; the one whose leader was lost gets its lowest rank left as leader); a worker that joined goes to
        the node of a worker on its host (with --ranks-per-node, to the smallest node), or to a node of its own.
        The node groups and the leaders' group are made again over the new group; a node's DDP broadcasts
        nothing when its replicas are equal already (the trainer set each back to its node's epoch start),
        and its leader's weights when a worker joined it."""
        model = super().rebind(ctx)
        members = ctx.group.members
        if ctx.world_size == 1:
            self.nodes, self._node, self._node_of = [[0]], [0], {members[0]: 0}
            for old in (self._node_group, self._leader_group):
                if old is not None:
                    old.close()
            self._node_group = self._leader_group = None
            self._buffer_bytes = 0
            return model
        # Each worker says its host and its node so far (a joiner has none): every rank computes the same layout.
        said = ctx.group.gather_objects("node membership", (socket.gethostname(), self._node_of.get(members[ctx.rank])))
        hosts = [host for host, _ in said]
        node_of = {rank: node for rank, (_, node) in enumerate(said) if node is not None}
        for rank in range(ctx.world_size):
            if said[rank][1] is not None:
                continue
            sizes: dict[int, int] = {}
            for other, node in node_of.items():
                sizes[node] = sizes.get(node, 0) + 1
            same_host = [node_of[other] for other in node_of if hosts[other] == hosts[rank]]
            if self.ranks_per_node is not None and sizes:
                node_of[rank] = min(sizes, key=lambda node: (sizes[node], node))
            elif self.ranks_per_node is None and same_host:
                node_of[rank] = same_host[0]
            else:
                node_of[rank] = max(node_of.values(), default=-1) + 1
        parts: dict[int, list[int]] = {}
        for rank in range(ctx.world_size):
            parts.setdefault(node_of[rank], []).append(rank)
        self._make_groups(ctx, sorted(parts.values()))
        joined = any(said[rank][1] is None for rank in self._node)
        return self._wrap(init_sync=joined)

    def after_step(self, step: int) -> None:
        self._count(intra=self._buffer_bytes)
        if len(self.nodes) > 1:
            self._diverged = True
            if self.every_steps is not None and step % self.every_steps == 0:
                self.synchronise()

    def end_epoch(self, epoch: int) -> bool:
        if self.every_steps is None and (epoch + 1) % self.every == 0:
            self.synchronise()
        return not self._diverged

    def finish(self) -> nn.Module:
        if self._diverged:
            self.synchronise()
        if self.ctx is not None:
            self._per_worker = self.ctx.group.gather_objects("summary", (self.intra_node_bytes, self.inter_node_bytes))
        return super().finish()

    def synchronise(self) -> None:
        """Average the node models among the leaders, then each leader's result to its node."""
        assert self.model is not None and self.ctx is not None
        if len(self.nodes) < 2:
            return
        self._diverged = False
        self.averages += 1
        if self.is_leader:
            sizes = {len(node) for node in self.nodes}
            if len(sizes) == 1:
                self._count(inter=average_module(self.model, group=self.leader_group))
            else:  # the mean over ranks: each node's model counts as many times as it has ranks
                self._count(inter=weighted_average_module(self.model, len(self._node), group=self.leader_group))
        if len(self._node) > 1:
            self._count(intra=broadcast_module(self.model, src=0, group=self.node_group))  # from its leader

    # -- records -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"comm_bytes": self.comm_bytes, "intra_node_bytes": self.intra_node_bytes,
                "inter_node_bytes": self.inter_node_bytes, "averages": self.averages, "diverged": self._diverged}

    def load_state_dict(self, state: dict) -> None:
        self.intra_node_bytes, self.inter_node_bytes = state["intra_node_bytes"], state["inter_node_bytes"]
        self.comm_bytes = self.intra_node_bytes + self.inter_node_bytes
        self.averages, self._diverged = state["averages"], state["diverged"]

    def summary(self) -> dict:
        per_worker = self._per_worker or [(self.intra_node_bytes, self.inter_node_bytes)]
        intra = [pair[0] for pair in per_worker]
        inter = [pair[1] for pair in per_worker]
        return {"nodes": self.nodes, "averages": self.averages,
                "intra_node_bytes": sum(intra), "inter_node_bytes": sum(inter),  # the summary's comm_bytes is their sum
                "intra_node_bytes_per_worker": intra, "inter_node_bytes_per_worker": inter}

    def describe(self) -> dict:
        return {"name": self.name, "every": self.every, "every_steps": self.every_steps,
                "ranks_per_node": self.ranks_per_node, "nodes": len(self.nodes) or None}
