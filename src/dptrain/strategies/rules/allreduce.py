"""allreduce's options and rules (dptrain.strategies.allreduce)."""

from __future__ import annotations

from typing import Any, Literal

from dptrain.strategies.rules import StrategyRules


class AllReduceRules(StrategyRules):
    class Options(StrategyRules.Options):
        compression: Literal["none", "fp16", "bf16", "int8"] = "none"

    @classmethod
    def check(cls, config: Any) -> None:
        if config.compression == "int8":
            raise ValueError("compression int8 applies to strategies sync, fedavg and async; allreduce compresses "
                             "its gradients with fp16 or bf16 only")
