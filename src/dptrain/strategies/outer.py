"""The server side of weight averaging, shared by sync and fedavg: average the changes, then an outer step.

One average, on every rank at once:

    anchor  = the global model of the last average (every rank holds the same one)
    change  = local - anchor                         (each worker's own)
    delta   = mean change over the ranks             (sample-weighted in fedavg)
    plain   = anchor + delta                         (= the plain average of the replicas)
    global  = outer step on the parameters with the pseudo-gradient g = anchor - plain = -delta;
              floating buffers (BatchNorm statistics) take `plain`, integer buffers the max

Every rank runs the same outer step on the same numbers, so every rank ends with the identical
global model, and the anchor becomes that model. With a sharded model (dptrain.strategies.sharded) a rank
averages, and steps, only its own shards, with the ranks holding the same shards: the anchor and the outer
optimizer's state are shards too.

How the mean is formed:
- compression `none`: the replicas themselves are averaged with one all_reduce per dtype
  (dptrain.strategies.collectives), exactly as before outer optimizers existed; the mean of the
  replicas is anchor + mean change.
- compression `fp16`, `bf16`, `int8`: the change of all parameters and floating buffers, as one
  flat float32 vector, goes through compressed_mean (dptrain.strategies.compression: the two-step
  mean, an all_to_all and an all_gather of chunks) with this worker's error feedback (and its
  server residual for its chunk of the mean); the global is anchor + the decoded mean change.

Outer optimizers (`--outer`, Reddi et al. 2021 "Adaptive Federated Optimization" call this the
server optimizer, DiLoCo the outer optimizer):
- `none`: global = plain (the classic average);
- `sgd`: torch SGD on the anchor with `--outer-lr` and `--outer-momentum` (heavy ball); lr 1 with
  momentum 0.9 is FedAvgM (Hsu et al. 2019), lr 1 with momentum 0 is `none`;
- `nesterov`: the same with Nesterov momentum (DiLoCo, Douillard et al. 2023, whose 0.7 / 0.9 are
  the defaults of `--outer-lr` / `--outer-momentum`);
- `adam`: FedAdam, the server update of Reddi et al. 2021 (Algorithm 2), without bias correction:
  m <- b1 m + (1 - b1) delta;  v <- b2 v + (1 - b2) delta^2;  x <- x + lr m / (sqrt(v) + tau).
  The defaults b1 = 0.9, b2 = 0.99 (`--outer-betas`) and tau = 1e-3 (`--outer-eps`) are the paper's
  (it fixes b1, b2 so for all its experiments, and tau = 1e-3 is its default adaptivity).
  `--outer-lr` is its server learning rate eta, which the paper tunes per task (for Adam the
  step of each coordinate is about eta, so eta well below DiLoCo's 0.7 is usual).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from dptrain.runtime.group import Group
from dptrain.runtime.sharded import local
from dptrain.strategies.collectives import (average_module, average_tensors, max_tensors, module_state,
                                            unflatten_into, weighted_average_module, weighted_average_tensors)
from dptrain.strategies.compression import COMPRESSIONS, ErrorFeedback, compressed_mean
from dptrain.strategies.rules.outer import OUTERS, outer_settings  # noqa: F401 - OUTERS: the names, re-exported

OPTIMIZER_STATES = ("keep", "reset", "average")


class OuterOptimizer:
    """The server step on the global parameters ("anchor"), given the plain average of the replicas."""

    def __init__(self, kind: str = "none", lr: Optional[float] = None, momentum: Optional[float] = None,
                 betas: Optional[Sequence[float]] = None, eps: Optional[float] = None) -> None:
        """Settings not given: dptrain.strategies.rules.outer's defaults for `kind`, as on the command line."""
        settings = outer_settings(kind, lr, momentum, betas, eps)  # also refuses an unknown kind
        lr, momentum, betas, eps = settings.outer_lr, settings.outer_momentum, settings.outer_betas, settings.outer_eps
        if (lr is not None and lr <= 0) or not 0 <= momentum < 1 or eps <= 0:  # none has no lr
            raise ValueError("outer lr and eps must be positive and momentum in [0, 1)")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"outer betas must be two numbers in [0, 1), not {tuple(betas)}")
        self.kind, self.lr, self.momentum, self.betas, self.eps = kind, lr, momentum, tuple(betas), eps
        self.anchor: list[torch.Tensor] = []
        self._sgd: Optional[torch.optim.Optimizer] = None
        self._m: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []

    def attach(self, params: Sequence[torch.Tensor]) -> None:
        """Take `params` (the global parameters, equal on every rank) as the anchor; fresh outer state."""
        # The outer step acts on a copy of the global parameters, the inner optimizer on the live ones.
        self.anchor = [p.detach().clone().requires_grad_(True) for p in params]
        if self.kind in ("sgd", "nesterov"):
            self._sgd = torch.optim.SGD(self.anchor, lr=self.lr, momentum=self.momentum,
                                        nesterov=self.kind == "nesterov" and self.momentum > 0)
        elif self.kind == "adam":
            self._m = [torch.zeros_like(a) for a in self.anchor]
            self._v = [torch.zeros_like(a) for a in self.anchor]

    @torch.no_grad()
    def step(self, params: Sequence[torch.Tensor]) -> None:
        """`params` hold the plain average; replace them (and the anchor) by the new global parameters."""
        if self.kind == "none":
            for anchor, param in zip(self.anchor, params):
                anchor.copy_(param)
            return
        if self.kind == "adam":
            beta1, beta2 = self.betas
            for anchor, param, m, v in zip(self.anchor, params, self._m, self._v):
                delta = param - anchor
                m.mul_(beta1).add_(delta, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(delta, delta, value=1 - beta2)
                anchor.addcdiv_(m, v.sqrt().add_(self.eps), value=self.lr)
        else:
            for anchor, param in zip(self.anchor, params):
                anchor.grad = anchor.detach() - param.detach()  # pseudo-gradient: old global - average
            self._sgd.step()
        for anchor, param in zip(self.anchor, params):
            param.copy_(anchor)

    def state_dict(self) -> dict:
        if self._sgd is not None:
            return self._sgd.state_dict()
        if self.kind == "adam":
            return {"m": [m.clone() for m in self._m], "v": [v.clone() for v in self._v]}
        return {}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        if self._sgd is not None:
            self._sgd.load_state_dict(state)
        elif self.kind == "adam":
            with torch.no_grad():
                for mine, saved in zip(self._m + self._v, state["m"] + state["v"]):
                    mine.copy_(saved)


def global_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The parameters the outer step acts on: this rank's shards of a sharded model (dptrain.runtime.sharded.local,
    sharing their storage), so that its anchor and momentum are shards too and no rank holds a whole model; every
    outer step is coordinate by coordinate, so stepping shard by shard is stepping the whole."""
    with torch.no_grad():
        return [local(parameter) for parameter in model.parameters()]


class Averager:
    """The whole pipeline of one average (see the module docstring), for sync and fedavg alike.

    `keep_anchor` keeps the global parameters even when neither an outer optimizer nor compression
    needs them (FedProx pulls each client towards them).
    """

    def __init__(self, outer: Optional[OuterOptimizer] = None, compression: str = "none",
                 keep_anchor: bool = False) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
        self.outer = outer or OuterOptimizer("none")
        self.compression = compression
        self.feedback = ErrorFeedback(compression) if compression != "none" else None
        self.uses_anchor = keep_anchor or compression != "none" or self.outer.kind != "none"
        self._buffer_anchor: list[torch.Tensor] = []  # floating buffers of the global model (compression)

    @property
    def anchor(self) -> list[torch.Tensor]:
        """The global parameters of the last average (empty when nothing needs them)."""
        return self.outer.anchor

    def attach(self, model: nn.Module) -> None:
        """`model` is the global model now (equal on every rank): make it the anchor."""
        if not self.uses_anchor:
            return
        self.outer.attach(global_parameters(model))
        if self.compression != "none":
            self._buffer_anchor = [t.detach().clone() for t in module_state(model)[0][len(self.anchor):]]

    def average(self, model: nn.Module, group: Group, weight: Optional[float] = None) -> int:
        """Replace the replicas by the new global model; return the bytes handed to collectives.

        `weight` (fedavg) weighs this rank's change (0: it contributes nothing but receives the result)."""
        sent = 0
        if group.world_size > 1:
            if self.compression != "none":
                sent = self._compressed_average(model, group, weight)
            elif weight is None:
                sent = average_module(model, group)
            else:
                sent = weighted_average_module(model, weight, group)
        if self.uses_anchor:
            self.outer.step(global_parameters(model))
            if self.compression != "none":
                with torch.no_grad():
                    for anchor, buffer in zip(self._buffer_anchor, module_state(model)[0][len(self.anchor):]):
                        anchor.copy_(buffer)
        return sent

    @torch.no_grad()
    def _compressed_average(self, model: nn.Module, group: Group, weight: Optional[float]) -> int:
        """Parameters and floating buffers become anchor + the compressed mean change; integer buffers the max."""
        floating, integer = module_state(model)
        if any(t.is_complex() for t in floating):
            raise ValueError("compressed averaging supports real floating-point parameters and buffers only")
        anchor = torch.cat([a.detach().reshape(-1).to(torch.float32) for a in self.anchor + self._buffer_anchor])
        local = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in floating])
        mean, sent = compressed_mean(local - anchor, self.feedback, weight, group)
        unflatten_into(floating, anchor + mean)
        return sent + max_tensors(integer, group)

    def state_dict(self) -> dict:
        return {"anchor": [a.detach() for a in self.anchor], "outer": self.outer.state_dict(),
                "buffer_anchor": list(self._buffer_anchor),
                "feedback": self.feedback.state_dict() if self.feedback else {}}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for anchor, saved in zip(self.anchor, state.get("anchor", [])):
                anchor.copy_(saved)
            for anchor, saved in zip(self._buffer_anchor, state.get("buffer_anchor", [])):
                anchor.copy_(saved)
        self.outer.load_state_dict(state.get("outer", {}))
        if self.feedback and state.get("feedback"):
            self.feedback.load_state_dict(state["feedback"])


# -- the inner (worker) optimizer's state at an average -------------------------------------------

def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Floating state tensors (momentum, Adam moments) in parameter order, so ranks line up; of a sharded model,
    this rank's shards of them (sharing their storage), averaged with the ranks holding the same shards."""
    tensors = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key in sorted(state):
                value = state[key]
                if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0:
                    with torch.no_grad():
                        tensors.append(local(value))
    return tensors


def settle_optimizer_state(optimizer: torch.optim.Optimizer, mode: str, group: Group,
                           weight: Optional[float] = None) -> int:
    """What happens to the workers' optimizer state at an average: `keep` it, `reset` it (fresh state,
    as classic FedAvg clients start each round), or `average` it over the ranks (`weight`-weighted
    when given). Returns the bytes handed to collectives."""
    if mode not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATES}, not {mode!r}")
    if mode == "reset":
        optimizer.state.clear()
    elif mode == "average" and group.world_size > 1:
        tensors = optimizer_tensors(optimizer)
        return average_tensors(tensors, group) if weight is None else weighted_average_tensors(tensors, weight, group)
    return 0
