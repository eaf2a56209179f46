"""sync's options and rules (dptrain.strategies.sync)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from dptrain.strategies.rules import StrategyRules, check_min_workers, check_one_period, trains_alone_for_epochs
from dptrain.strategies.rules.outer import OuterOptions


class SyncRules(StrategyRules):
    class Options(OuterOptions):
        sync_every: int = Field(1, ge=1)
        sync_every_steps: Optional[int] = Field(None, ge=1)
        allreduce_epochs: int = Field(0, ge=0)
        min_workers: Optional[int] = Field(None, ge=1)

    no_other_world = None  # a worker's state is a copy of the average (or its own, kept): one serves a new worker

    @classmethod
    def check(cls, config: Any) -> None:
        check_one_period(config)
        check_min_workers(config)

    @classmethod
    def scales_lr(cls, config: Any) -> bool:
        return trains_alone_for_epochs(config)
