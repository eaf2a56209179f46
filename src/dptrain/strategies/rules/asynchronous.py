"""async's options and rules (dptrain.strategies.asynchronous)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from dptrain.strategies.rules import StrategyRules, check_min_workers, refuse_step_checkpoints, trains_alone_for_epochs


class AsyncRules(StrategyRules):
    class Options(StrategyRules.Options):
        sync_every: int = Field(1, ge=1)
        merge: Literal["delta", "ema", "delayed-nesterov"] = "delta"
        max_staleness: Optional[int] = Field(None, ge=0)
        server_momentum: float = Field(0.9, ge=0, lt=1)
        server_lr: float = Field(1.0, gt=0)
        compression: Literal["none", "fp16", "bf16", "int8"] = "none"
        min_workers: Optional[int] = Field(None, ge=1)

    no_other_world = "each worker's model and its versions at the merge service belong to its rank"

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
