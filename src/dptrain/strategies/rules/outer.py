"""The outer (server) optimizer's settings and their defaults, in one table for the CLI, YAML and Python.

`--outer-lr` when not given: DiLoCo's 0.7, FedAvgM's server learning rate 1 (none for `none`, which adopts
the average and has no learning rate), and for FedAdam a step of about 0.01 per coordinate (Reddi et al. tune it per task). The
momentum (sgd, nesterov) and FedAdam's B1, B2 and tau are the papers' values. TrainConfig's defaults and
`Sync(outer=...)` / `FedAvg(outer=...)` both resolve through `outer_settings`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from dptrain.strategies.rules import StrategyRules

OUTERS = ("none", "sgd", "nesterov", "adam")
OUTER_LR_DEFAULTS: dict[str, Optional[float]] = {"none": None, "nesterov": 0.7, "sgd": 1.0, "adam": 0.01}
OUTER_MOMENTUM = 0.9
OUTER_BETAS = (0.9, 0.99)
OUTER_EPS = 1e-3


class OuterSettings(BaseModel):
    """One outer optimizer, every setting resolved."""

    model_config = ConfigDict(frozen=True)

    outer: str = "none"
    outer_lr: Optional[float] = OUTER_LR_DEFAULTS["none"]  # None: `none` has no learning rate
    outer_momentum: float = OUTER_MOMENTUM
    outer_betas: tuple[float, float] = OUTER_BETAS
    outer_eps: float = OUTER_EPS


def outer_settings(outer: str = "none", lr: Optional[float] = None, momentum: Optional[float] = None,
                   betas: Optional[tuple[float, float]] = None, eps: Optional[float] = None) -> OuterSettings:
    """The settings of outer optimizer `outer`, each not given (None) from the table of defaults. Their
    ranges are checked where they are used (TrainConfig's fields, dptrain.strategies.outer.OuterOptimizer)."""
    if outer not in OUTERS:
        raise ValueError(f"outer must be one of {OUTERS}, not {outer!r}")
    return OuterSettings(outer=outer, outer_lr=OUTER_LR_DEFAULTS[outer] if lr is None else lr,
                         outer_momentum=OUTER_MOMENTUM if momentum is None else momentum,
                         outer_betas=OUTER_BETAS if betas is None else tuple(betas),
                         outer_eps=OUTER_EPS if eps is None else eps)


def betas_from_text(value: Any) -> Any:
    """B1,B2 as typed on the command line ("0.9,0.99") or a YAML list; each in [0, 1)."""
    if isinstance(value, str):
        value = value.replace(" ", "").split(",")
    try:
        betas = tuple(float(b) for b in value)
    except (TypeError, ValueError):
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError("must be two numbers B1,B2, each at least 0 and below 1, e.g. 0.9,0.99")
    return betas


class OuterOptions(StrategyRules.Options):
    """The outer optimizer's options, shared by sync and fedavg (TrainConfig resolves outer_lr's default)."""

    optimizer_state: Literal["keep", "reset", "average"] = Field(
        "keep", description="sync, fedavg: what happens to the workers' optimizer state at an average "
                            "(reset: fresh each round, classic FedAvg)")
    outer: Literal[OUTERS] = Field(  # type: ignore[valid-type] - the names above
        "none", description="sync, fedavg: outer (server) optimizer on the mean change: none (adopt the average), "
                            "sgd (FedAvgM with --outer-lr 1), nesterov (DiLoCo), adam (FedAdam)")
    outer_lr: Optional[float] = Field(None, gt=0, description=f"sync, fedavg: outer learning rate (default: "
                                                               f"{OUTER_LR_DEFAULTS['nesterov']:g} for nesterov as "
                                                               f"DiLoCo, {OUTER_LR_DEFAULTS['sgd']:g} for sgd as "
                                                               f"FedAvgM, {OUTER_LR_DEFAULTS['adam']:g} for adam; none "
                                                               f"has no outer learning rate)")
    outer_momentum: float = Field(OUTER_MOMENTUM, ge=0, lt=1, description="sync, fedavg: outer momentum (sgd, nesterov)")
    outer_betas: Annotated[tuple[float, float], BeforeValidator(betas_from_text)] = Field(
        OUTER_BETAS, description="sync, fedavg: --outer adam's B1,B2 (FedAdam)")
    outer_eps: float = Field(OUTER_EPS, gt=0, description="sync, fedavg: --outer adam's tau added to sqrt(v) (FedAdam)")
