"""auto's options and rules (dptrain.strategies.auto)."""

from __future__ import annotations

from typing import Any, Literal

from dptrain import registry
from pydantic import Field

from dptrain.costmodel import ALL_CANDIDATES, SAFE_CANDIDATES
from dptrain.strategies.rules import CompressionOption, StrategyRules, check_min_workers

# Auto decides how often its pick averages: these settings of the strategies it may pick are its own choice.
CHOSEN_BY_AUTO = ("sync_every", "sync_every_steps")


class AutoRules(StrategyRules):
    class Options(CompressionOption):
        auto_candidates: Literal["safe", "all"] = Field(
            "safe", description="auto: candidates to pick from: safe (allreduce, sync every epoch) or all (also sync "
                                "every 2 or 3 epochs and async, which may cost accuracy)")

    no_other_world = "it chose its strategy by measuring the world it started in"

    @classmethod
    def reads(cls, config: Any) -> tuple[str, ...]:
        """Its own options and those of every strategy among its candidates, which it builds from the same
        settings (dptrain.strategies.auto.Auto.build), less the period that it chooses itself."""
        candidates = ALL_CANDIDATES if config.auto_candidates == "all" else SAFE_CANDIDATES
        picked = (registry.load("strategy rules", name).option_names()
                  for name in dict.fromkeys(candidate.strategy for candidate in candidates))
        return tuple(dict.fromkeys([*cls.option_names(), *(option for options in picked for option in options
                                                           if option not in CHOSEN_BY_AUTO)]))

    @classmethod
    def check(cls, config: Any) -> None:
        check_min_workers(config)
        if (config.replace_workers or config.max_workers is not None) and config.auto_candidates == "all":
            flag = "--replace-workers (and --workers MIN:MAX) do" if config.replace_workers else "--max-workers does"
            raise ValueError(f"{flag} not apply to --auto-candidates all: it "
                             "may pick async, whose workers never stand at an epoch end together for a new one to "
                             "enter at; use --auto-candidates safe")
        if config.compression == "int8":
            raise ValueError("compression int8 does not apply to strategy auto: it may pick allreduce, which "
                             "compresses its gradients with fp16 or bf16 only")
