"""hierarchical's options and rules (dptrain.strategies.hierarchical)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from dptrain.strategies.rules import StrategyRules


class HierarchicalRules(StrategyRules):
    class Options(StrategyRules.Options):
        sync_every: int = Field(1, ge=1)
        sync_every_steps: Optional[int] = Field(None, ge=1)
        ranks_per_node: Optional[int] = Field(None, ge=1)

    exclusive = ("sync_every_steps", "ranks_per_node")

    @classmethod
    def check(cls, config: Any) -> None:
        if config.compression != "none":
            raise ValueError(f"compression applies to strategies allreduce, sync, fedavg and async, not {config.strategy}")
