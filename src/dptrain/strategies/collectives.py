"""Whole-module collectives (broadcast, average) over a run's Group, with byte counts.

Tensors are flattened per dtype so that one module costs one collective per dtype, whatever
its tree looks like: nested modules, layers without bias, bare nn.Parameters, buffers. Each
function takes the Group to communicate in (runtime/group.py); without one, the whole job.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from dptrain.runtime.group import Group
from dptrain.runtime.sharded import local


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def module_state(module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(floating tensors to average, integer and bool tensors to max): all parameters and buffers.

    The max of bool buffers (masks, flags) is their logical OR across replicas. A sharded model's parameters
    are this rank's shards (dptrain.runtime.sharded.local): an average over the ranks holding the same shard
    averages the model shard by shard."""
    floating: list[torch.Tensor] = [local(parameter) for parameter in module.parameters()]
    integer: list[torch.Tensor] = []
    for buffer in module.buffers():
        if buffer.is_floating_point() or buffer.is_complex():
            floating.append(buffer)
        else:
            integer.append(buffer)  # e.g. BatchNorm's num_batches_tracked, a bool mask
    return floating, integer


def _by_dtype(tensors: Iterable[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        groups[tensor.dtype].append(tensor)
    return groups


def _group(group: Optional[Group]) -> Group:
    return group if group is not None else Group.default()


def _apply_flat(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], int]) -> int:
    """Run `collective(flat)` (which returns the bytes it handed over) on one flat copy per dtype
    and write the result back; return the bytes."""
    sent = 0
    for same_dtype in _by_dtype(tensors).values():
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1) for t in same_dtype])
            if flat.dtype == torch.bool:  # not every backend reduces bool: as bytes, 0 and 1
                flat = flat.to(torch.uint8)
            sent += collective(flat)
            unflatten_into(same_dtype, flat)
    return sent


def unflatten_into(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of `flat` back into `tensors` (the inverse of concatenating them)."""
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        tensor.copy_(flat[offset:offset + count].view_as(tensor))
        offset += count


def average_tensors(tensors: list[torch.Tensor], group: Optional[Group] = None) -> int:
    """Replace each tensor by its mean over all ranks (in place); return bytes handed over."""
    group = _group(group)

    def mean(flat: torch.Tensor) -> int:
        sent = group.all_reduce(flat, "sum")
        flat.div_(group.world_size)
        return sent

    return _apply_flat(tensors, mean)


def max_tensors(tensors: list[torch.Tensor], group: Optional[Group] = None) -> int:
    group = _group(group)
    return _apply_flat(tensors, lambda flat: group.all_reduce(flat, "max"))


def average_module(module: nn.Module, group: Optional[Group] = None) -> int:
    """Average parameters and floating buffers across ranks; integer buffers take the max."""
    floating, integer = module_state(module)
    return average_tensors(floating, group) + max_tensors(integer, group)


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0, group: Optional[Group] = None) -> int:
    """Make every rank's `tensors` equal to rank `src`'s (`src`: a rank in `group`), in place; return bytes
    handed over."""
    group = _group(group)
    return _apply_flat(tensors, lambda flat: group.broadcast(flat, src))


def broadcast_module(module: nn.Module, src: int = 0, group: Optional[Group] = None) -> int:
    """Make every rank's parameters and buffers equal to rank `src`'s (a rank in `group`)."""
    floating, integer = module_state(module)
    return broadcast_tensors(floating + integer, src, group)


def weighted_average_tensors(tensors: list[torch.Tensor], weight: float, group: Optional[Group] = None) -> int:
    """Replace each tensor by its `weight`-weighted mean over ranks (in place).

    A rank with weight 0 contributes nothing but still receives the result. Returns the bytes
    handed over, the total weight (8 bytes) included."""
    group = _group(group)
    device = tensors[0].device if tensors else torch.device("cpu")
    total = torch.tensor([float(weight)], dtype=torch.float64, device=device)
    sent = group.all_reduce(total, "sum")
    total_weight = total.item()
    if total_weight <= 0:
        raise ValueError("the weights of all ranks sum to zero")

    def weighted_mean(flat: torch.Tensor) -> int:
        flat.mul_(weight)
        handed = group.all_reduce(flat, "sum")
        flat.div_(total_weight)
        return handed

    return sent + _apply_flat(tensors, weighted_mean)


def weighted_average_module(module: nn.Module, weight: float, group: Optional[Group] = None) -> int:
    """Replace parameters and floating buffers by their `weight`-weighted mean over ranks; integer
    buffers take the max. Returns the bytes handed over (the total weight included)."""
    floating, integer = module_state(module)
    return weighted_average_tensors(floating, weight, group) + max_tensors(integer, group)
