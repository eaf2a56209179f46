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

    @classmethod
    def other_world_refused(cls, config: Any, within_epoch: bool = False) -> Optional[str]:
        # At an epoch end a worker's state serves a new one as under sync: the nodes are laid out anew over the
        # new world at setup, and each node's DDP starts from its leader's state.
        if within_epoch:
            return ("a checkpoint within an epoch holds each node's replica apart from the others', and the nodes are "
                    "laid out anew on another number of workers")
        return None

    @classmethod
    def check(cls, config: Any) -> None:
        check_one_period(config)
        check_min_workers(config)
