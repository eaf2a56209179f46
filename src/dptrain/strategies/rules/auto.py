"""auto's options and rules (dptrain.strategies.auto)."""

from __future__ import annotations

from typing import Any, Literal

from dptrain.strategies.rules import StrategyRules


class AutoRules(StrategyRules):
    class Options(StrategyRules.Options):
        auto_candidates: Literal["safe", "all"] = "safe"
        compression: Literal["none", "fp16", "bf16", "int8"] = "none"

    @classmethod
    def check(cls, config: Any) -> None:
        if config.compression == "int8":
            raise ValueError("compression int8 does not apply to strategy auto: it may pick allreduce, which "
                             "compresses its gradients with fp16 or bf16 only")
