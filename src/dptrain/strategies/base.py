"""The strategy interface: what a data-parallel strategy communicates, and when.

The Trainer's loop is the same for every strategy; it calls these hooks at fixed points.
Adding a strategy means adding one file with one subclass and registering its name.
"""

from __future__ import annotations

import torch
from torch import nn

from dptrain.runtime.distributed import DistContext


class Strategy:
    """Base class: no communication at all (each worker trains alone).

    `comm_bytes` counts the payload this worker hands to collectives: the bytes of every
    tensor passed to all_reduce/broadcast (after compression), whatever the algorithm
    underneath moves on the wire. With one worker no strategy communicates.
    """

    name = "local"
    # True when workers never wait for each other during training (no per-epoch gathering).
    barrier_free = False

    def __init__(self) -> None:
        self.comm_bytes = 0
        self.ctx: DistContext | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def from_config(cls, config) -> "Strategy":
        """The strategy a TrainConfig asks for (its strategy-specific fields)."""
        return cls()

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        """Prepare the model (wrap it, make replicas equal); return the module to train."""
        self.model, self.optimizer, self.ctx = model, optimizer, ctx
        return model

    def after_backward(self, model: nn.Module) -> None:
        """Called after loss.backward(), before the optimizer step (gradients exist)."""

    def after_step(self, step: int) -> None:
        """Called after optimizer.step(); `step` counts steps from 1 over the whole run."""

    def end_epoch(self, epoch: int) -> bool:
        """Called after each epoch (from 0). Return True when the replicas now hold one global model."""
        return self.ctx is None or self.ctx.world_size == 1

    def finish(self) -> nn.Module:
        """The final global model (unwrapped), after any last communication."""
        assert self.model is not None, "setup() was not called"
        return self.model

    def evaluation_target(self) -> "tuple[nn.Module | None, bool]":
        """(module to evaluate on this rank or None, whether all ranks evaluate it together)."""
        return self.model, True

    def partition(self, labels, world: int, seed: int) -> "list | None":
        """Fixed per-worker sample indices for the whole run, or None for the shared per-epoch sharding."""
        return None

    def trains_in_epoch(self, epoch: int) -> bool:
        """False when this worker sits out the epoch (e.g. a federated client not sampled this round)."""
        return True

    def state_dict(self) -> dict:
        """What a checkpoint must hold to continue exactly (tensors, numbers, lists, dicts only)."""
        return {"comm_bytes": self.comm_bytes}

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict() output; called after setup()."""
        self.comm_bytes = state["comm_bytes"]

    def summary(self) -> dict:
        """Strategy-specific results for summary.json (after finish)."""
        return {}

    def describe(self) -> dict:
        """Strategy settings for summaries."""
        return {"name": self.name}
