"""allreduce's options and rules (dptrain.strategies.allreduce)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from dptrain.strategies.rules import CompressionOption, MinWorkersOption, StrategyRules, check_min_workers


class AllReduceRules(StrategyRules):
    class Options(CompressionOption, MinWorkersOption):
        # A lost worker's part of the epoch is dropped; the others redo it over a new DDP on themselves, from
        # the epoch's start or (commit_every_steps) from their latest commit within it.
        commit_every_steps: Optional[int] = Field(None, ge=1, description="with --min-workers: every N steps each "
                                                  "worker keeps its state in memory, and when one is lost the others "
                                                  "go on from their latest such commit, the rest of the epoch's rows "
                                                  "shared over them, instead of from the epoch's start (default: the "
                                                  "epoch's start)")

    no_other_world = None  # every worker holds the same model and optimizer state

    @classmethod
    def check(cls, config: Any) -> None:
        check_min_workers(config)
        if config.commit_every_steps is not None and config.min_workers is None:
            raise ValueError(f"--commit-every-steps {config.commit_every_steps} needs --min-workers: the commits are "
                             "where the workers left go on from when one is lost")
        if config.compression == "int8":
            raise ValueError("compression int8 applies to strategies sync, fedavg and async; allreduce compresses "
                             "its gradients with fp16 or bf16 only")
