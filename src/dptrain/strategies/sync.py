"""sync: workers train alone and average their weights every E epochs (or every K steps).

One averaging step all-reduces every parameter and floating-point buffer (BatchNorm running
statistics included) and takes the max of integer buffers, for any module tree. The optimizer
state is kept, reset or averaged. With `outer="nesterov"` the average is not adopted directly:
the averaged delta from the last global model is treated as a pseudo-gradient for an outer
Nesterov-momentum SGD step (DiLoCo).
"""

from __future__ import annotations

import torch
from torch import nn

from dptrain.runtime.distributed import DistContext
from dptrain.strategies.base import Strategy
from dptrain.strategies.collectives import average_module, average_tensors, broadcast_module

OPTIMIZER_STATES = ("keep", "reset", "average")
OUTERS = ("none", "nesterov")


class Sync(Strategy):
    """Synchronous weight averaging at epoch ends (every `every` epochs) or local SGD
    (every `every_steps` steps)."""

    name = "sync"

    def __init__(self, every: int = 1, every_steps: int | None = None, optimizer_state: str = "keep",
                 outer: str = "none", outer_lr: float = 0.7, outer_momentum: float = 0.9) -> None:
        super().__init__()
        if every < 1 or (every_steps is not None and every_steps < 1):
            raise ValueError("every and every_steps must be at least 1")
        if optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATES}, not {optimizer_state!r}")
        if outer not in OUTERS:
            raise ValueError(f"outer must be one of {OUTERS}, not {outer!r}")
        self.every, self.every_steps = every, every_steps
        self.optimizer_state, self.outer = optimizer_state, outer
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.averages = 0
        self._diverged = False  # replicas changed since the last average
        self._anchor: list[torch.Tensor] = []
        self._outer_optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def from_config(cls, config) -> "Sync":
        return cls(every=config.sync_every, every_steps=config.sync_every_steps,
                   optimizer_state=config.optimizer_state, outer=config.outer,
                   outer_lr=config.outer_lr, outer_momentum=config.outer_momentum)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        super().setup(model, optimizer, ctx)
        if ctx.world_size > 1:
            self.comm_bytes += broadcast_module(model)
        if self.outer == "nesterov":
            # The outer step acts on a copy of the global parameters ("anchor"), the inner
            # optimizer on the live ones; only parameters take the outer step, buffers are averaged.
            self._anchor = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
            self._outer_optimizer = torch.optim.SGD(self._anchor, lr=self.outer_lr, momentum=self.outer_momentum,
                                                    nesterov=self.outer_momentum > 0)
        return model

    def after_step(self, step: int) -> None:
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
        return super().finish()

    def synchronise(self) -> None:
        """Average the replicas (and apply the outer step); afterwards all replicas are equal."""
        assert self.model is not None and self.ctx is not None and self.optimizer is not None
        self._diverged = False
        self.averages += 1
        if self.ctx.world_size > 1:
            self.comm_bytes += average_module(self.model)
        if self._outer_optimizer is not None:
            self._outer_step()
        if self.optimizer_state == "reset":
            self.optimizer.state.clear()
        elif self.optimizer_state == "average" and self.ctx.world_size > 1:
            self.comm_bytes += average_tensors(self._optimizer_tensors())

    def _outer_step(self) -> None:
        with torch.no_grad():
            for anchor, param in zip(self._anchor, self.model.parameters()):
                anchor.grad = anchor.detach() - param.detach()  # pseudo-gradient: old global - average
            self._outer_optimizer.step()
            for anchor, param in zip(self._anchor, self.model.parameters()):
                param.copy_(anchor)

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """Floating state tensors (momentum, Adam moments) in parameter order, so ranks line up."""
        tensors = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state.get(param, {})
                for key in sorted(state):
                    value = state[key]
                    if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0:
                        tensors.append(value)
        return tensors

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(averages=self.averages, diverged=self._diverged, anchor=[a.detach() for a in self._anchor],
                     outer=self._outer_optimizer.state_dict() if self._outer_optimizer else {})
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.averages, self._diverged = state["averages"], state["diverged"]
        with torch.no_grad():
            for anchor, saved in zip(self._anchor, state["anchor"]):
                anchor.copy_(saved)
        if self._outer_optimizer and state["outer"]:
            self._outer_optimizer.load_state_dict(state["outer"])

    def describe(self) -> dict:
        return {"name": self.name, "every": self.every, "every_steps": self.every_steps,
                "optimizer_state": self.optimizer_state, "outer": self.outer,
                "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum}
