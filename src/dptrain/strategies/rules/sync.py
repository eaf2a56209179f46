"""sync's options and rules (dptrain.strategies.sync)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from dptrain.strategies.rules import (CompressionOption, MinWorkersOption, PeriodOptions, StrategyRules, check_min_workers,
                                      check_one_period, trains_alone_for_epochs)
from dptrain.strategies.rules.outer import OuterOptions


class SyncRules(StrategyRules):
    class Options(OuterOptions, CompressionOption, PeriodOptions, MinWorkersOption):
        allreduce_epochs: int = Field(0, ge=0, description="sync: all-reduce the gradients every step for the first N "
                                                           "epochs, then average periodically (post-local SGD)")

    no_other_world = None  # a worker's state is a copy of the average (or its own, kept): one serves a new worker

    @classmethod
    def check(cls, config: Any) -> None:
        check_one_period(config)
        check_min_workers(config)

    @classmethod
    def scales_lr(cls, config: Any) -> bool:
        return trains_alone_for_epochs(config)
