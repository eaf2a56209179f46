"""hierarchical's options and rules (dptrain.strategies.hierarchical)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from dptrain.strategies.rules import MinWorkersOption, PeriodOptions, StrategyRules, check_min_workers, check_one_period


class HierarchicalRules(StrategyRules):
    class Options(PeriodOptions, MinWorkersOption):
        ranks_per_node: Optional[int] = Field(None, ge=1, description="hierarchical: ranks per node (ranks [kN, (k+1)N) "
                                                                      "form node k), instead of the host names and the "
                                                                      "launcher's local world size")

    no_other_world = "its groups of ranks are made per node"

    @classmethod
    def check(cls, config: Any) -> None:
        check_one_period(config)
        check_min_workers(config)
