"""async's options and rules (dptrain.strategies.asynchronous)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from dptrain.strategies.rules import (CompressionOption, EpochPeriodOption, MinWorkersOption, StrategyRules,
                                      check_min_workers, refuse_step_checkpoints, trains_alone_for_epochs)


class AsyncRules(StrategyRules):
    class Options(EpochPeriodOption, CompressionOption, MinWorkersOption):
        merge: Literal["delta", "ema", "delayed-nesterov"] = Field(
            "delta", description="async: global += delta/W (delta), the reference's (G+P)/2 (ema), or delta/W plus "
                                 "server Nesterov momentum on the mean delta once every W merges (delayed-nesterov)")
        server_momentum: float = Field(0.9, ge=0, lt=1, description="async, merge delayed-nesterov: server momentum")
        server_lr: float = Field(1.0, gt=0, description="async, merge delayed-nesterov: server learning rate")
        max_staleness: Optional[int] = Field(None, ge=0, description="async: refresh from the global model when more "
                                                                     "than S versions behind")

    # At an epoch end (async has no checkpoints within one): rank 0 continues the global model of the lowest
    # writer (the service's host: a takeover makes the lowest live rank rank 0), each worker the model, optimizer
    # and base of the writer at its place, a worker beyond their number a copy of one (its merge counts from 0).
    no_other_world = None

    no_step_checkpoints = ("its workers never stand at the same step (no barrier) and merges are in flight "
                           "between them, so files written within an epoch are no one state of the run")

    @classmethod
    def check(cls, config: Any) -> None:
        refuse_step_checkpoints(cls, config)
        check_min_workers(config)
        replacing = getattr(config, "replace_workers", False)
        if replacing or getattr(config, "max_workers", None) is not None:
            flag = "--replace-workers (and --workers MIN:MAX) start" if replacing else "--max-workers lets dptrain join add"
            raise ValueError(f"{flag} a new worker that enters at an epoch end all workers stand at, which "
                             "async's never do; use --min-workers alone")
        if config.merge == "ema" and config.compression != "none":
            raise ValueError(f"compression {config.compression} applies to async merges of deltas (delta, "
                             "delayed-nesterov), not to merge ema, which sends whole models")

    @classmethod
    def scales_lr(cls, config: Any) -> bool:
        return trains_alone_for_epochs(config)
