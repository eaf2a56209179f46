"""The learning-rate policy in one place: defaults, scaling for W workers, warm-up, schedules, the line that says it.

TrainConfig holds and validates the settings (`lr`, `lr_scaling`, `warmup_epochs`, `lr_schedule`, ...)
and asks this module what they mean; `dptrain train` builds the optimizer's LR and schedule from it,
and `--strategy auto` (dptrain.strategies.auto) rescales with `rescale_for` once it has chosen.
Nothing here imports torch at import time, so the config (and `dptrain --help`) stays light.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from dptrain import registry

# The default LR rule: keep the user's --lr. On the tuning half of the robustness suite no rule held one
# worker's accuracy on every problem, and scaling cost up to 20 points where --lr was already near the edge
# of stability (benchmarks/README.md, "Robust defaults"); auto is opt-in, with the table saying when it pays.
DEFAULT_LR_SCALING = "none"

# --lr when not given, per optimizer: of 0.05, 0.02 and 0.01 (and Adam's 0.001) the steadiest for one worker
# on the tuning half of benchmarks/robustness.py (benchmarks/README.md, "Robust defaults").
LR_DEFAULTS = {"sgd": 0.02, "adam": 0.01, "adamw": 0.01}


# -- scaling and warm-up: what a TrainConfig's LR settings mean for W workers ------------------------------------

def lr_scale(config: Any, world: int) -> tuple[float, str]:
    """(factor the LR is multiplied by for `world` workers, the rule that gave it: none, linear, sqrt or auto).

    Replicas trained on disjoint shards and averaged behave like one model trained with a W times larger
    batch at the same LR; a larger LR can give back the step size, or tip training over (benchmarks/README.md,
    "Robust defaults"). `auto` multiplies by W only where replicas train alone for whole epochs between
    averages (sync every epoch or more, async, fedavg over iid partitions) and the trainer can check each
    average: it warms up, and backs off towards --lr when an average goes wrong (dptrain.train.health).
    Replicas that meet every few steps (--sync-every-steps, --allreduce-epochs) are one large-batch model,
    as allreduce is, and keep --lr; so does fedavg under label skew."""
    rule = "linear" if config.scale_lr else config.lr_scaling
    if rule == "auto" and not auto_scales(config):
        rule = "none"
    if world == 1:
        return 1.0, rule
    return {"none": 1.0, "linear": float(world), "auto": float(world), "sqrt": math.sqrt(world)}[rule], rule


def auto_scales(config: Any) -> bool:
    """Whether --lr-scaling auto raises this run's LR (see lr_scale): the strategy's rules say, where its
    replicas train alone for whole epochs between averages that the trainer checks (dptrain.train.health)."""
    return registry.load("strategy rules", config.strategy).scales_lr(config)


def warmup(config: Any, world: int) -> float:
    """Epochs of linear LR warm-up: --warmup-epochs when given; else, when --lr-scaling auto scales the
    LR, a tenth of the run up to 5 epochs (Goyal et al. warm up for 5 of 90), else none."""
    if config.warmup_epochs is not None:
        return config.warmup_epochs
    factor, rule = lr_scale(config, world)
    if rule == "auto" and factor != 1:
        return min(5.0, config.epochs / 10)
    return 0.0


def guarded_scale(config: Any, world: int) -> float:
    """The factor the trainer's LR guard may back off from (dptrain.train.health): auto's scale; 1 otherwise."""
    factor, rule = lr_scale(config, world)
    return factor if rule == "auto" else 1.0


def lr_line(config: Any, world: int) -> str:
    """The line that says a run's LR was scaled for its workers (and warmed up), and how to keep --lr."""
    factor, rule = lr_scale(config, world)
    warm = warmup(config, world)
    warming = (f", warmed up over {warm:g} epoch{'' if warm == 1 else 's'}"
               if warm and config.warmup_epochs is None else "")
    guarded = ", backed off if an average goes wrong" if rule == "auto" else ""
    return (f"dptrain: {config.strategy} on {world} workers trains with learning rate {config.lr * factor:g} "
            f"({config.lr:g} x {factor:.3g}, {rule_asked(config, rule)}{warming}{guarded}); "
            f"--lr-scaling none keeps {config.lr:g}")


def lr_kept_line(config: Any, world: int) -> Optional[str]:
    """The line for a run that asked for an LR rule (not the default) which keeps --lr here (auto under allreduce,
    any rule on one worker), so that the rule asked for is not silently without effect; None otherwise."""
    factor, rule = lr_scale(config, world)
    if factor != 1 or (config.lr_scaling == DEFAULT_LR_SCALING and not config.scale_lr):
        return None
    return f"dptrain: {config.strategy} on {world} worker{'s' if world > 1 else ''} keeps learning rate " \
           f"{config.lr:g} ({rule_asked(config, rule)})"


def rule_asked(config: Any, rule: str) -> str:
    """The LR rule in effect and how it came to be: '--lr-scaling sqrt', '--lr-scaling none, the default',
    '--scale-lr, i.e. --lr-scaling linear', '--lr-scaling auto, which keeps the LR of allreduce'."""
    if config.scale_lr:
        return f"--scale-lr, i.e. --lr-scaling {rule}"
    if config.lr_scaling == DEFAULT_LR_SCALING:
        return f"--lr-scaling {rule}, the default"
    if config.lr_scaling != rule:
        return f"--lr-scaling {config.lr_scaling}, which keeps the LR of {config.strategy}"
    return f"--lr-scaling {rule}"


# -- schedules ----------------------------------------------------------------------------------------------------

def lr_factor(step: int, *, steps_per_epoch: int, epochs: int, schedule: str = "constant",
              warmup_epochs: float = 0.0, step_epochs: int = 30, gamma: float = 0.1) -> float:
    """Multiplier of the base LR used for optimizer step `step` (counted from 0)."""
    total = max(1, steps_per_epoch * epochs)
    if schedule == "constant":
        factor = 1.0
    elif schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
    elif schedule == "step":
        factor = gamma ** ((step // steps_per_epoch) // step_epochs)
    else:
        raise ValueError(f"unknown LR schedule {schedule!r}")
    warmup_steps = round(warmup_epochs * steps_per_epoch)
    if step < warmup_steps:
        factor *= (step + 1) / warmup_steps
    return factor


def build_schedule(optimizer, *, steps_per_epoch: int, epochs: int, schedule: str = "constant",
                   warmup_epochs: float = 0.0, step_epochs: int = 30, gamma: float = 0.1):
    """A per-step torch LambdaLR: the trainer calls .step() after every optimizer step."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, lambda step: lr_factor(
        step, steps_per_epoch=steps_per_epoch, epochs=epochs, schedule=schedule,
        warmup_epochs=warmup_epochs, step_epochs=step_epochs, gamma=gamma))


@dataclass(frozen=True)
class ConfigSchedule:
    """The Trainer's `schedule(optimizer, steps_per_epoch, epochs)` that a TrainConfig describes for `world`
    workers (its warm-up depends on the scaling rule, so on the strategy)."""

    config: Any
    world: int

    def __call__(self, optimizer, steps_per_epoch: int, epochs: int):
        config = self.config
        return build_schedule(optimizer, steps_per_epoch=steps_per_epoch, epochs=epochs, schedule=config.lr_schedule,
                              warmup_epochs=warmup(config, self.world), step_epochs=config.lr_step_epochs,
                              gamma=config.lr_gamma)


# -- rescaling once a strategy is chosen (--strategy auto) ---------------------------------------------------------

@dataclass(frozen=True)
class Rescaled:
    """What changes when `strategy` replaces the strategy the LR was set for."""

    schedule: Any  # the Trainer's schedule to use from now on
    lr_scale: float  # the Trainer's lr_scale (guarded_scale for the chosen strategy)
    line: Optional[str]  # what to log (None: the LR did not change)


def rescale_for(config: Any, strategy: str, world: int, optimizer, schedule) -> Rescaled:
    """--lr-scaling auto scales the LR as `--strategy <strategy>` would (the launcher could not know it before
    the choice); an explicit rule was already applied for every strategy alike. Multiplies the LR of
    `optimizer`'s groups by the change; a ConfigSchedule of `config` follows the new strategy (its warm-up),
    any other schedule is kept."""
    chosen = config.model_copy(update={"strategy": strategy})
    applied, _ = lr_scale(config, world)
    wanted, _ = lr_scale(chosen, world)
    if wanted == applied:
        return Rescaled(schedule, guarded_scale(chosen, world), None)
    for group in optimizer.param_groups:
        group["lr"] *= wanted / applied
    if isinstance(schedule, ConfigSchedule) and schedule.config is config:
        schedule = replace(schedule, config=chosen)
    return Rescaled(schedule, guarded_scale(chosen, world), lr_line(chosen, world))
