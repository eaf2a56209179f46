"""sync's options and rules (dptrain.strategies.sync)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from dptrain.strategies.rules import StrategyRules, trains_alone_for_epochs
from dptrain.strategies.rules.outer import OUTER_BETAS, OUTER_EPS, OUTER_MOMENTUM


class OuterOptions(StrategyRules.Options):
    """The outer optimizer's options, shared by sync and fedavg (defaults: dptrain.strategies.rules.outer)."""

    optimizer_state: Literal["keep", "reset", "average"] = "keep"
    outer: Literal["none", "sgd", "nesterov", "adam"] = "none"
    outer_lr: Optional[float] = Field(None, gt=0)  # None: the outer optimizer's default
    outer_momentum: float = Field(OUTER_MOMENTUM, ge=0, lt=1)
    outer_betas: tuple[float, float] = OUTER_BETAS
    outer_eps: float = Field(OUTER_EPS, gt=0)
    compression: Literal["none", "fp16", "bf16", "int8"] = "none"


class SyncRules(StrategyRules):
    class Options(OuterOptions):
        sync_every: int = Field(1, ge=1)
        sync_every_steps: Optional[int] = Field(None, ge=1)
        allreduce_epochs: int = Field(0, ge=0)

    exclusive = ("sync_every_steps", "outer", "allreduce_epochs")

    @classmethod
    def scales_lr(cls, config: Any) -> bool:
        return trains_alone_for_epochs(config)
