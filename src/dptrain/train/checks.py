"""The checks of one run around its averages: is averaging helping, may a scaled LR stay, did training diverge.

`Checks` composes dptrain.train.health's AverageHealth (the check of every average, the collapse
line) and LRGuard (--lr-scaling auto's guard) with the divergence checks (weights not finite, or a
training loss LOSS_GROWTH_LIMIT times the first epoch's). The trainer calls it at fixed points of
the epoch; a checkpoint within an epoch and the heal of a joiner carry its state.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from dptrain.errors import Diverged
from dptrain.runtime.sharded import local
from dptrain.train.health import AverageHealth, LRGuard

LOSS_GROWTH_LIMIT = 10.0  # a training loss this many times the first epoch's is divergence


def grew(loss: float, first: float) -> bool:
    """Whether a training loss is past LOSS_GROWTH_LIMIT times the first epoch's (divergence)."""
    return math.isfinite(first) and first > 0 and loss > LOSS_GROWTH_LIMIT * first


def finite(model: nn.Module) -> bool:
    values = [torch.isfinite(local(p)).all() for p in model.parameters()]  # a sharded model: this rank's shards
    return not values or bool(torch.stack(values).all())  # one device sync, not one a tensor


class Checks:
    """The check of every average, when the strategy averages at epoch ends on more than one worker (with
    `job`, whatever the world now: a joiner's, as the job's workers made theirs), the guard of a scaled LR,
    and the divergence checks."""

    def __init__(self, ctx, train, strategy, loss_fn: Callable, classify: Optional[bool], seed: int, *,
                 check_averages: bool, lr_scale: float, log: Callable[[str], None], rank_log: Callable[[str], None],
                 job: bool = False) -> None:
        self.ctx, self.strategy = ctx, strategy
        self.health: Optional[AverageHealth] = None
        self.lr_guard: Optional[LRGuard] = None
        if not check_averages or (ctx.world_size == 1 and not job) or strategy.average_check is None:
            return
        log = log if strategy.average_check == "together" else rank_log
        self.health = AverageHealth(ctx, train, loss_fn, classify, strategy.average_check == "together", seed, log)
        self.lr_guard = LRGuard(lr_scale, strategy.restores_average(), log) if lr_scale > 1 else None

    # -- where they start from -------------------------------------------------------------
    def start(self, model: nn.Module) -> None:
        """A run from its start (or from an epoch end's checkpoint): the first measure."""
        if self.health is not None:
            start_loss = self.health.start(model)
            if self.lr_guard is not None:
                self.lr_guard.start(model, start_loss)

    def position(self) -> dict:
        """What a checkpoint within an epoch keeps of them."""
        return {"health": self.health.state_dict() if self.health is not None else {},
                "lr_guard": ({"best_loss": self.lr_guard.best_loss, "good": self.lr_guard.good_state()}
                             if self.lr_guard is not None else {})}

    def resume(self, saved: dict) -> None:
        """The checks as they stood at a checkpoint within an epoch (`position`)."""
        if self.health is not None and saved["health"]:
            self.health.load_state_dict(saved["health"])
        if self.lr_guard is not None and saved["lr_guard"]:
            self.lr_guard.resume(saved["lr_guard"]["best_loss"], saved["lr_guard"]["good"])

    def heal_state(self) -> dict:
        """What a joiner is healed with of them: the LR guard's kept average decides whether a divergence can be
        taken back, and every worker must decide alike."""
        return {"health": self.health.state_dict() if self.health is not None else None,
                "lr_guard_good": self.lr_guard.good_state() if self.lr_guard is not None else None}

    def load_heal(self, state: dict) -> None:
        if self.health is not None and state["health"] is not None:
            self.health.load_state_dict(state["health"])
        if self.lr_guard is not None and state["lr_guard_good"] is not None:
            self.lr_guard.resume(self.lr_guard.best_loss, state["lr_guard_good"])

    # -- at the epoch's end ------------------------------------------------------------------
    def recover_or_check(self, module: nn.Module, model: nn.Module, epoch: int, train_loss: float,
                         history: list[dict], optimizer: torch.optim.Optimizer, scheduler) -> Optional[dict]:
        """Divergence in an epoch (weights not finite, or a training loss 10x the first epoch's): under a scaled
        LR that the guard can take back (ranks that average together, the last good average kept), every rank
        returns to that average with half the scale, and this returns what happened; else the run stops.
        `module`: what trains (the strategy's), `model`: the user's module in it."""
        lr_guard = self.lr_guard
        if lr_guard is None or not lr_guard.can_recover or self.strategy.average_check != "together":
            self.check_finite(module, epoch, train_loss, history)
            return None
        first = history[0]["train_loss"] if history else math.nan
        diverged = not finite(module) or not math.isfinite(train_loss) or grew(train_loss, first)
        if not self.ctx.group.any_rank("divergence check", diverged):
            return None
        return lr_guard.recover(epoch + 1, model, optimizer, scheduler)

    def before_average(self, model: nn.Module, trained: bool) -> None:
        if self.health is not None:
            self.health.before(model, trained)

    def after_average(self, model: nn.Module, epoch: int, trained: bool, optimizer: torch.optim.Optimizer,
                      scheduler) -> dict:
        """Measure the average this epoch end made; say when averaging collapses; let the LR guard act.
        Returns what metrics.jsonl records about it."""
        health = self.health
        check = health.after(model, epoch, trained)
        checked: dict = {"average_check": check.record()}
        line = health.verdict(check)
        if line is not None:
            health.log(line)
            checked["collapse"] = line.removeprefix("dptrain: ")
        if self.lr_guard is not None:
            backoff = self.lr_guard.judge(check, model, optimizer, scheduler)
            if backoff is not None:
                checked["lr_backoff"] = backoff
        return checked

    def check_loss_growth(self, epoch: int, history: list[dict]) -> None:
        """Stop a run whose training loss (over the workers) became 10x its first epoch's: it diverges even
        when the weights are still finite."""
        first, last = history[0]["train_loss"], history[-1]["train_loss"]
        if len(history) > 1 and grew(last, first):
            raise Diverged(f"rank {self.ctx.rank}: training diverged in epoch {epoch + 1}: the training loss "
                           f"{last:.4g} is more than {LOSS_GROWTH_LIMIT:g}x the first epoch's {first:.4g}; "
                           "lower --lr (or --lr-scaling none), clip gradients (--grad-clip) or warm up (--warmup-epochs)")

    def check_finite(self, model: nn.Module, epoch: int, loss: float, history: list[dict]) -> None:
        """Stop a run whose weights became NaN or infinite (they never recover, and an average would spread
        them to every replica): one line naming the rank and epoch; earlier checkpoints stay."""
        if finite(model):
            return
        before = next((f"; the epoch before, it was {r['train_loss']:.4g}" for r in reversed(history)
                       if math.isfinite(r["train_loss"])), "")
        raise Diverged(f"rank {self.ctx.rank}: training diverged in epoch {epoch + 1}: the weights became NaN or "
                       f"infinite (training loss {loss:.4g}{before}); lower --lr, clip gradients (--grad-clip) or "
                       "warm up (--warmup-epochs)")
