"""streaming's options and rules (dptrain.strategies.streaming)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from dptrain.strategies.rules import (MinWorkersOption, PeriodOptions, StrategyRules, check_min_workers, check_one_period,
                                      refuse_step_checkpoints)


class StreamingRules(StrategyRules):
    # A lost worker's part of the epoch is dropped (min_workers), with the average then in flight; the others redo it.
    class Options(PeriodOptions, MinWorkersOption):
        overlap_steps: Optional[int] = Field(None, ge=0, description="streaming: steps of training while an average "
                                                                     "travels, before waiting for it (default: half the "
                                                                     "period, rounded up; 0 is sync)")
        fragments: int = Field(1, ge=1, description="streaming: average 1/F of the model per period, the F parts in "
                                                    "rotation")

    # At an epoch end nothing is in flight and g is the same on every rank; the fragment in rotation counts the
    # run's sends, not a rank's place: a worker's state is its own replica and g, one serves a new worker.
    no_other_world = None

    no_step_checkpoints = ("its fragment averages stay in flight across steps (overlap_steps), "
                           "which no checkpoint holds")

    @classmethod
    def check(cls, config: Any) -> None:
        check_one_period(config)
        refuse_step_checkpoints(cls, config)
        check_min_workers(config)
        if (config.overlap_steps is not None and config.sync_every_steps is not None
                and config.overlap_steps > config.sync_every_steps):
            raise ValueError(f"overlap_steps {config.overlap_steps} is more than sync_every_steps "
                             f"{config.sync_every_steps}; an average must land before the next one is sent, "
                             f"so use at most {config.sync_every_steps}")
