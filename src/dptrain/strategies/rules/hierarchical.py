"""hierarchical's options and rules (dptrain.strategies.hierarchical)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from dptrain.strategies.rules import StrategyRules, check_min_workers, check_one_period


class HierarchicalRules(StrategyRules):
    class Options(StrategyRules.Options):
        sync_every: int = Field(1, ge=1)
        sync_every_steps: Optional[int] = Field(None, ge=1)
        ranks_per_node: Optional[int] = Field(None, ge=1)
        min_workers: Optional[int] = Field(None, ge=1)

    no_other_world = "its groups of ranks are made per node"

    @classmethod
    def check(cls, config: Any) -> None:
        check_one_period(config)
        check_min_workers(config)
