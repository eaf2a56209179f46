"""What each strategy takes from a TrainConfig and which combinations it refuses, without torch.

A strategy class (dptrain.strategies.NAME) inherits these class-level hooks from its rules class here
(dptrain.strategies.rules.NAME), so that config validation (dptrain.config) and the LR policy
(dptrain.lr_policy) can ask them through dptrain.registry without importing torch:

- `Options`: a pydantic model of the TrainConfig fields the strategy reads, with its defaults; an option
  of some strategy given to a strategy that does not read it is refused, naming those that do
  (dptrain.config: the one rule for settings that do not apply). Each option is declared once, here in
  its rules (type, default, range, `--help` text): an option one strategy reads in the strategy's module,
  one several read as an option class of its own below (or outer.OuterOptions), which their Options
  inherit; TrainConfig's strategy section is made of the registered strategies' Options (dptrain.config);
- `check(config)`: the cross-field rules that concern the strategy (raise ValueError with one sentence);
- `scales_lr(config)`: whether --lr-scaling auto scales this run's LR (its replicas train alone for whole
  epochs between averages that the trainer checks, dptrain.train.health);
- `check_before_spawn(config, model)` (on the strategy class, which may import torch): what can be
  checked of the model before workers start.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


# What the refusal of another number of workers says works instead (the strategies whose rules allow it).
RESUME_ON_ANY_NUMBER = ("allreduce, sync, streaming, async and fedavg with iid partitions resume on any number, "
                        "hierarchical at an epoch end")


class StrategyRules:
    """The defaults: no options, no rules, the LR is not scaled, nothing to check before spawning."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

    # Why this strategy cannot checkpoint within an epoch (--checkpoint-every-steps), or None when it can.
    no_step_checkpoints: ClassVar[Optional[str]] = None
    # Why a run of this strategy cannot resume on another number of workers than wrote its checkpoint, or
    # None when it can (every worker holds the model alike, or a copy of it serves a new worker, and the
    # rest of an epoch is re-planned over the new world: dptrain.train.checkpointer).
    no_other_world: ClassVar[Optional[str]] = "each worker's state belongs to its place in the world"
    # Whether it reads partitions of its own of map-style data (fedavg's), which shards read as a stream are not.
    own_partitions: ClassVar[bool] = False

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The TrainConfig fields this strategy reads."""
        return tuple(cls.Options.model_fields)

    @classmethod
    def reads(cls, config: Any) -> tuple[str, ...]:
        """The TrainConfig fields this strategy reads with `config`: its options (auto: also those of the
        strategies it may pick); a setting of another strategy's given to it is refused (dptrain.config)."""
        return cls.option_names()

    @classmethod
    def options(cls, config: Any) -> BaseModel:
        """This strategy's options as a TrainConfig (or any object with those attributes) sets them."""
        return cls.Options(**{name: getattr(config, name) for name in cls.option_names()})

    @classmethod
    def check(cls, config: Any) -> None:
        """Raise ValueError (one sentence) when `config` combines settings this strategy refuses."""

    @classmethod
    def scales_lr(cls, config: Any) -> bool:
        """Whether --lr-scaling auto raises this run's LR (dptrain.lr_policy.lr_scale)."""
        return False

    @classmethod
    def other_world_refused(cls, config: Any, within_epoch: bool = False) -> Optional[str]:
        """Why `config`'s run cannot resume on another number of workers (from a checkpoint within an epoch:
        `within_epoch`), or None when it can."""
        return cls.no_other_world

    @classmethod
    def check_before_spawn(cls, config: Any, model: Any) -> None:
        """Raise dptrain.errors.UserError when `model` or the worker count cannot train with this strategy."""


# -- the options more than one strategy reads, each declared once: a strategy's Options inherits those it reads --

class MinWorkersOption(StrategyRules.Options):
    """--min-workers: the strategy goes on without a lost worker (check_min_workers below)."""

    min_workers: Optional[int] = Field(None, ge=1, description="local launcher or srun: when a worker (rank 0 too) "
                                       "fails or freezes, the others go on without it from the start of that "
                                       "epoch (allreduce: from their last commit, --commit-every-steps), as long "
                                       "as N remain; one warned alone leaves at the epoch end; async: without "
                                       "going back, rank 0 too; with --shard hybrid N counts replica groups, and a "
                                       "group that lost a rank leaves whole (default: a failure ends the run)")


class CompressionOption(StrategyRules.Options):
    """--compression: what the strategy sends, compressed (dptrain.strategies.compression)."""

    compression: Literal["none", "fp16", "bf16", "int8"] = Field(
        "none", description="allreduce: gradient compression through a DDP communication hook (fp16, bf16); "
                            "sync, fedavg, async: compressed averaging of the change since the global model "
                            "(fp16, bf16, int8 with per-block scales), with error feedback")


class EpochPeriodOption(StrategyRules.Options):
    """--sync-every: how many epochs between averages (merges)."""

    sync_every: int = Field(1, ge=1, description="sync, streaming, hierarchical, async: average (merge) the weights "
                                                 "every E epochs")


class PeriodOptions(EpochPeriodOption):
    """--sync-every or --sync-every-steps: the averaging period in epochs or steps (check_one_period below)."""

    sync_every_steps: Optional[int] = Field(None, ge=1, description="sync, streaming, hierarchical: average every K "
                                                                    "steps instead (local SGD)")


def check_min_workers(config: Any) -> None:
    """--min-workers (every strategy): ValueError where it cannot hold."""
    if config.min_workers is None:
        return
    if config.min_workers > config.workers:
        raise ValueError(f"--min-workers {config.min_workers} is more than --workers {config.workers}; "
                         f"use 1 to {config.workers} (started by srun or mpirun yourself, give --workers as the "
                         "job's ranks)")
    if config.checkpoint_every_steps:
        raise ValueError("--min-workers goes back to the start of an epoch when a worker is lost, which "
                         "--checkpoint-every-steps does not keep yet; drop one of them")


def refuse_step_checkpoints(rules: type[StrategyRules], config: Any) -> None:
    """--checkpoint-every-steps with a strategy that checkpoints only at epoch ends: ValueError."""
    if rules.no_step_checkpoints and getattr(config, "checkpoint_every_steps", 0):
        raise ValueError(step_checkpoints_refused(config.strategy, rules.no_step_checkpoints, "--checkpoint-every-steps",
                                                  "--checkpoint-every"))


def step_checkpoints_refused(strategy: str, why: str, setting: str = "checkpoint_every_steps",
                             epoch_setting: str = "checkpoint_every") -> str:
    """The one sentence refusing checkpoints within an epoch to `strategy` (named as a flag on the command line,
    as a keyword in Python)."""
    return f"{setting} does not apply to strategy {strategy}: {why}; it checkpoints at epoch ends ({epoch_setting})"


def trains_alone_for_epochs(config: Any) -> bool:
    """Replicas that meet every few steps (--sync-every-steps, --allreduce-epochs) are one large-batch model,
    as allreduce is; only whole epochs alone between averages let --lr-scaling auto scale the LR."""
    return config.sync_every_steps is None and not config.allreduce_epochs


def check_one_period(config: Any) -> None:
    """--sync-every (epochs) and --sync-every-steps both set the averaging period: one of them, not both."""
    if config.sync_every_steps is not None and config.sync_every != 1:
        raise ValueError(f"sync_every {config.sync_every} and sync_every_steps {config.sync_every_steps} both "
                         "set how often to average; give one of them")
