"""Bounded waits on other ranks, by context: the functions of a run's Group (runtime/group.py).

Kept for callers that hold a DistContext rather than its group; each is one line into
`ctx.group`, where the waiting policy and the collectives live.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

from dptrain.runtime.distributed import DistContext


def guard(ctx: DistContext, what: str, action: Callable[[], Any], *,
          communication_failed: Union[bool, Callable[[], bool]] = True) -> Any:
    """Run `action`; turn a failed or timed-out wait on another rank into one line naming it."""
    return ctx.group.bounded(what, action, communication_failed=communication_failed)


def broadcast_object(ctx: DistContext, what: str, value: Any, src: int = 0) -> Any:
    """Rank `src`'s `value` on every rank."""
    return ctx.group.broadcast_object(what, value, src)


def gather_objects(ctx: DistContext, what: str, value: Any) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    return ctx.group.gather_objects(what, value)


def any_rank(ctx: DistContext, what: str, flag: bool) -> bool:
    """Whether `flag` is true on at least one rank (every rank waits for all)."""
    return ctx.group.any_rank(what, flag)


def sum_tensor(ctx: DistContext, what: str, values: torch.Tensor) -> torch.Tensor:
    """`values` summed over all ranks (returned on the CPU)."""
    return ctx.group.sum_tensor(what, values)
