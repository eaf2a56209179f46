"""fedavg's options and rules (dptrain.strategies.fedavg)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from dptrain.strategies.rules import (CompressionOption, MinWorkersOption, StrategyRules, check_min_workers,
                                      trains_alone_for_epochs)
from dptrain.strategies.rules.outer import OuterOptions


class FedAvgRules(StrategyRules):
    own_partitions = True  # each client's partition of the data (--partition iid, contiguous, dirichlet)

    # A lost client's share of the round is dropped (min_workers); the others are partitioned again over the live world.
    class Options(OuterOptions, CompressionOption, MinWorkersOption):
        partition: Literal["iid", "contiguous", "dirichlet"] = Field("iid", description="fedavg: how samples are split "
                                                                                        "over clients")
        alpha: float = Field(0.5, gt=0, description="fedavg: Dirichlet concentration of the label skew (small = strong "
                                                    "skew)")
        local_epochs: int = Field(1, ge=1, description="fedavg: local epochs per round")
        clients_per_round: float = Field(1.0, gt=0, le=1, description="fedavg: fraction of clients sampled each round")
        proximal_mu: float = Field(0.0, ge=0, description="fedavg: FedProx, adds MU*(w - w_global) to each client's "
                                                          "gradient (0: plain FedAvg)")

    @classmethod
    def check(cls, config: Any) -> None:
        check_min_workers(config)
        if config.proximal_mu and config.amp == "fp16":
            raise ValueError("proximal_mu does not work with amp fp16 (the term would join loss-scaled gradients); "
                             "use amp bf16 or none")
        if config.optimizer_state == "average" and config.clients_per_round < 1:
            raise ValueError("optimizer_state average with fedavg needs every client in every round "
                             "(clients_per_round 1): a client that sat a round out has no state to average")

    @classmethod
    def other_world_refused(cls, config: Any, within_epoch: bool = False) -> Optional[str]:
        # iid partitions are drawn again over the new world at an epoch end, as after a lost client.
        if config.partition != "iid":
            return f"its {config.partition} partitions give each client data of its own, which iid ones do not"
        if within_epoch:
            return "a checkpoint within an epoch holds each client's place in its own partition, one at an epoch end does not"
        return None

    @classmethod
    def scales_lr(cls, config: Any) -> bool:
        # Under label skew (non-iid partitions) the clients' models drift apart: --lr stays.
        return config.partition == "iid" and trains_alone_for_epochs(config)
