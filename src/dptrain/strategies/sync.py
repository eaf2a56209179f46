"""sync: workers train alone and average their weights every E epochs (or every K steps).

One averaging step averages every parameter and floating-point buffer (BatchNorm running
statistics included) and takes the max of integer buffers, for any module tree; with
`compression` fp16, bf16 or int8 the workers' changes since the last global model are averaged
compressed, with error feedback. An outer optimizer (`outer`: none, sgd, nesterov, adam) then
turns the mean change into the new global model (DiLoCo's Nesterov step, FedAvgM, FedAdam; see
dptrain.strategies.outer). The optimizer state is kept, reset or averaged.

Post-local SGD (Lin et al. 2020, "Don't use large mini-batches, use local SGD"):
`allreduce_epochs N` all-reduces the gradients every step for the first N epochs, exactly as
the allreduce strategy does, then switches to periodic averaging. The model is wrapped in
DistributedDataParallel for the whole run, with the DDP communication hook allreduce uses
(so the first N epochs are the allreduce strategy's, bucketed and overlapped with the backward
pass); at the switch the hook starts handing back each worker's own gradient untouched, as
PyTorch's post_localSGD_hook does once local SGD starts, and DDP stops re-broadcasting buffers.
We switch by a flag the strategy sets at the epoch boundary (and restores from its checkpoint)
rather than by PostLocalSGDState's own step counter, which lives outside our checkpoints and
counts steps, not epochs; and the averaging after the switch is this strategy's own (buffers,
outer optimizer, compression), which PyTorch's PeriodicModelAverager does not do.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dptrain.runtime.distributed import DistContext
from dptrain.strategies.base import Meeting, Strategy, check_period
from dptrain.strategies.collectives import broadcast_module, broadcast_tensors, module_state, tensor_bytes
from dptrain.strategies.compression import COMPRESSIONS
from dptrain.strategies.outer import OPTIMIZER_STATES, OUTERS, Averager, OuterOptimizer, settle_optimizer_state
from dptrain.strategies.rules.outer import outer_settings
from dptrain.strategies.rules.sync import SyncRules
from dptrain.strategies.rules.sharding import AVERAGING_PLAIN, averaging_refused
from dptrain.strategies.sharded import Shardable

__all__ = ["OPTIMIZER_STATES", "OUTERS", "Sync"]


class Sync(Shardable, SyncRules, Strategy):
    """Synchronous weight averaging at epoch ends (every `every` epochs) or local SGD
    (every `every_steps` steps), optionally after `allreduce_epochs` epochs of per-step
    gradient all-reduce (post-local SGD). With a sharded model (`shard_as`), the replica groups average their
    parameter shards, each rank over the ranks holding its shard, and an outer step acts on the shards
    (dptrain.strategies.sharded)."""

    name = "sync"
    meeting = Meeting("epoch ends", averages_checked=True)

    def __init__(self, every: int = 1, every_steps: int | None = None, optimizer_state: str = "keep",
                 outer: str = "none", outer_lr: float | None = None, outer_momentum: float | None = None,
                 outer_betas: tuple[float, float] | None = None, outer_eps: float | None = None,
                 compression: str = "none", allreduce_epochs: int = 0) -> None:
        """The outer optimizer's settings not given come from dptrain.strategies.rules.outer, as on the CLI."""
        super().__init__()
        settings = outer_settings(outer, outer_lr, outer_momentum, outer_betas, outer_eps)
        outer_lr, outer_momentum = settings.outer_lr, settings.outer_momentum
        outer_betas, outer_eps = settings.outer_betas, settings.outer_eps
        check_period(every, every_steps)
        if optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATES}, not {optimizer_state!r}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
        if allreduce_epochs < 0:
            raise ValueError("allreduce_epochs must be at least 0")
        self.every, self.every_steps = every, every_steps
        self.optimizer_state, self.outer = optimizer_state, outer
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.outer_betas, self.outer_eps = tuple(outer_betas), outer_eps
        self.compression, self.allreduce_epochs = compression, allreduce_epochs
        self.averager = Averager(OuterOptimizer(outer, outer_lr, outer_momentum, outer_betas, outer_eps),
                                 compression)
        self.averages = 0
        self.epochs_done = 0
        self._diverged = False  # replicas changed since the last average
        self._ddp: DistributedDataParallel | None = None
        self._buffer_bytes = 0

    @classmethod
    def from_config(cls, config) -> "Sync":
        return cls(every=config.sync_every, every_steps=config.sync_every_steps,
                   optimizer_state=config.optimizer_state, outer=config.outer, outer_lr=config.outer_lr,
                   outer_momentum=config.outer_momentum, outer_betas=config.outer_betas,
                   outer_eps=config.outer_eps, compression=config.compression,
                   allreduce_epochs=config.allreduce_epochs)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        super().setup(model, optimizer, ctx)
        train_model = model
        if self.shard_options is not None:
            train_model = self._shard_setup(model, optimizer, ctx, average_gradients=False)
        elif ctx.world_size > 1 and self.allreduce_epochs > 0:
            train_model = self._wrap(model, ctx)
        elif ctx.world_size > 1:
            self.comm_bytes += broadcast_module(model, group=self.ctx.group)
        self.averager.attach(model)
        return train_model

    def join_sharded(self, ctx: DistContext) -> None:
        """A rank of a replica group that joins: sharded, then its anchor and outer state (--outer) made as this
        rank's shards, their values healed from its peer in a live group as the shards are."""
        super().join_sharded(ctx)
        self.averager.attach(self.model)

    # -- post-local SGD: per-step gradient all-reduce for the first epochs ---------------------
    @property
    def allreducing(self) -> bool:
        """Whether gradients are still all-reduced every step (the first `allreduce_epochs` epochs)."""
        return self.epochs_done < self.allreduce_epochs

    def _wrap(self, model: nn.Module, ctx: DistContext, init_sync: bool = True) -> DistributedDataParallel:
        # DDP's constructor broadcasts rank 0's parameters and buffers (`init_sync`); while it all-reduces
        # it re-broadcasts the buffers before every forward (as in the allreduce strategy).
        if init_sync:
            floating, integer = module_state(model)
            self.comm_bytes += tensor_bytes(floating + integer)
        self._buffer_bytes = tensor_bytes(model.buffers())
        self._ddp = ctx.group.data_parallel(model, init_sync=init_sync)
        if not self.allreducing:
            self._ddp.broadcast_buffers = False

        # In the local phase each worker keeps its own gradient: no communication.
        hook = self.gradient_hook(ctx.group, self._add_bytes, active=lambda: self.allreducing)
        self._ddp.register_comm_hook(state=None, hook=hook)
        return self._ddp

    def rebind(self, ctx: DistContext) -> nn.Module:
        """With --allreduce-epochs, a new DDP on the new group, broadcasting nothing: while it all-reduces the
        replicas are equal, and after that each keeps its own (alone: the model unwrapped; a worker that joined,
        or one alone that others joined, wraps it again)."""
        model = super().rebind(ctx)
        if self.allreduce_epochs == 0:
            return model
        if ctx.world_size == 1:
            self._ddp, self._buffer_bytes = None, 0
            return model
        return self._wrap(model, ctx, init_sync=False)

    def _start_local_phase(self) -> None:
        """The switch: rank 0's buffers everywhere (what DDP's next forward would do), a new anchor."""
        if self._ddp is not None:
            self._ddp.broadcast_buffers = False
            self.comm_bytes += broadcast_tensors(list(self.model.buffers()), group=self.ctx.group)
        self.averager.attach(self.model)

    # -- the hooks -----------------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        if self.allreducing:
            self.comm_bytes += self._buffer_bytes
            return
        self._diverged = True
        if self.every_steps is not None and step % self.every_steps == 0:
            self.synchronise()

    def end_epoch(self, epoch: int) -> bool:
        was_allreducing = self.allreducing
        self.epochs_done = epoch + 1
        if was_allreducing:
            if not self.allreducing:
                self._start_local_phase()
            return True
        local_epochs = self.epochs_done - self.allreduce_epochs
        if self.every_steps is None and local_epochs % self.every == 0:
            self.synchronise()
        return not self._diverged

    def averaging_events(self) -> int:
        return self.averages

    def restores_average(self) -> bool:
        return not self.averager.uses_anchor and not self.allreducing

    def finish(self) -> nn.Module:
        if self._diverged:
            self.synchronise()
        return super().finish()

    def synchronise(self) -> None:
        """Average the replicas (and apply the outer step); afterwards all replicas are equal."""
        assert self.model is not None and self.ctx is not None and self.optimizer is not None
        self._diverged = False
        self.averages += 1
        group = self.replicas.across if self.replicas is not None else self.ctx.group  # sharded: shard by shard
        self.comm_bytes += self.averager.average(self.model, group)
        self.comm_bytes += settle_optimizer_state(self.optimizer, self.optimizer_state, group)

    def refused_with_sharding(self, shard: str) -> str | None:
        """The settings a sharded sync refuses (dptrain.strategies.rules.sharding), given from Python."""
        return averaging_refused(self.name, shard, {key: getattr(self, key) for key in AVERAGING_PLAIN})

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(averages=self.averages, diverged=self._diverged, epochs_done=self.epochs_done,
                     **self.averager.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.averages, self._diverged = state["averages"], state["diverged"]
        self.epochs_done = state.get("epochs_done", 0)
        if self._ddp is not None and not self.allreducing:
            self._ddp.broadcast_buffers = False
        self.averager.load_state_dict(state)

    def describe(self) -> dict:
        return {"name": self.name, "every": self.every, "every_steps": self.every_steps,
                "optimizer_state": self.optimizer_state, "outer": self.outer,
                "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                "outer_betas": list(self.outer_betas), "outer_eps": self.outer_eps,
                "compression": self.compression, "allreduce_epochs": self.allreduce_epochs, **self.sharding()}
