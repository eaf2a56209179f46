"""Waiting on other ranks: collectives for bookkeeping, each bounded, a failure turned into one line.

`guard(ctx, what, action)` runs a piece of communication; if it fails because a peer is
gone or stuck, it raises PeerFailure naming the silent rank (from heartbeats). Which errors
count as a peer failure is decided by *where* they happen, not by their wording: torch's own
distributed error types always do, and so does any error of an operation that only
communicates (our collectives on tensors we built). An error in code that also runs the
user's model (the backward pass) counts only when the communication in it is known to have
failed (`communication_failed`), so a bug in a user's model keeps its own traceback.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Union

import torch
import torch.distributed as dist

from dptrain.runtime.distributed import DistContext, PeerFailure


def guard(ctx: DistContext, what: str, action: Callable[[], Any], *,
          communication_failed: Union[bool, Callable[[], bool]] = True) -> Any:
    """Run `action`; turn a failed or timed-out wait on another rank into one line naming it."""
    begun = time.perf_counter()
    try:
        return action()
    except (dist.DistError, RuntimeError) as exc:
        if ctx.world_size == 1:
            raise
        if not isinstance(exc, dist.DistError):
            failed = communication_failed() if callable(communication_failed) else communication_failed
            if not failed:
                raise
        waited = time.perf_counter() - begun
        who = ctx.heartbeat.silent_peers() if ctx.heartbeat else "no heartbeat store to tell which peer"
        raise PeerFailure(
            f"rank {ctx.rank}: {what} failed after {waited:.1f} s (timeout {ctx.timeout:g} s): {who}; "
            f"cause: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def broadcast_object(ctx: DistContext, what: str, value: Any, src: int = 0) -> Any:
    """Rank `src`'s `value` on every rank."""
    if ctx.world_size == 1:
        return value
    box = [value]
    guard(ctx, what, lambda: dist.broadcast_object_list(box, src=src))
    return box[0]


def gather_objects(ctx: DistContext, what: str, value: Any) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if ctx.world_size == 1:
        return [value]
    gathered: list = [None] * ctx.world_size
    guard(ctx, what, lambda: dist.all_gather_object(gathered, value))
    return gathered


def any_rank(ctx: DistContext, what: str, flag: bool) -> bool:
    """Whether `flag` is true on at least one rank (every rank waits for all)."""
    if ctx.world_size == 1:
        return flag
    value = torch.tensor([1 if flag else 0], device=ctx.collective_device)
    guard(ctx, what, lambda: dist.all_reduce(value, op=dist.ReduceOp.MAX))
    return bool(value.item())


def sum_tensor(ctx: DistContext, what: str, values: torch.Tensor) -> torch.Tensor:
    """`values` summed over all ranks (returned on the CPU)."""
    if ctx.world_size == 1:
        return values
    reduced = values.to(ctx.collective_device)
    guard(ctx, what, lambda: dist.all_reduce(reduced))
    return reduced.cpu()


