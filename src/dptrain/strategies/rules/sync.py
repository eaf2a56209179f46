"""sync's options and rules (dptrain.strategies.sync)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from dptrain.strategies.rules import StrategyRules, check_one_period, trains_alone_for_epochs
from dptrain.strategies.rules.outer import OuterOptions


class SyncRules(StrategyRules):
    class Options(OuterOptions):
        sync_every: int = Field(1, ge=1)
        sync_every_steps: Optional[int] = Field(None, ge=1)
        allreduce_epochs: int = Field(0, ge=0)
        min_workers: Optional[int] = Field(None, ge=1)

    @classmethod
    def check(cls, config: Any) -> None:
        check_one_period(config)
        if config.min_workers is None:
            return
        if config.min_workers > config.workers:
            raise ValueError(f"--min-workers {config.min_workers} is more than --workers {config.workers}; "
                             f"use 1 to {config.workers}")
        if config.allreduce_epochs:
            raise ValueError("--min-workers cannot go on without a worker during --allreduce-epochs (their "
                             "DistributedDataParallel is bound to the first workers); drop one of them")
        if config.checkpoint_every_steps:
            raise ValueError("--min-workers goes back to the start of an epoch when a worker is lost, which "
                             "--checkpoint-every-steps does not keep yet; drop one of them")

    @classmethod
    def scales_lr(cls, config: Any) -> bool:
        return trains_alone_for_epochs(config)
