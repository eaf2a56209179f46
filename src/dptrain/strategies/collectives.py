"""Whole-module collectives (broadcast, average) built on torch.distributed, with byte counts.

Tensors are flattened per dtype so that one module costs one collective per dtype, whatever
its tree looks like: nested modules, layers without bias, bare nn.Parameters, buffers.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def module_state(module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(floating tensors to average, integer and bool tensors to max): all parameters and buffers.

    The max of bool buffers (masks, flags) is their logical OR across replicas."""
    floating: list[torch.Tensor] = list(module.parameters())
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


def _apply_flat(tensors: list[torch.Tensor], collective) -> int:
    """Run `collective(flat)` on one flat copy per dtype and write the result back; return bytes."""
    sent = 0
    for same_dtype in _by_dtype(tensors).values():
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1) for t in same_dtype])
            if flat.dtype == torch.bool:  # not every backend reduces bool: as bytes, 0 and 1
                flat = flat.to(torch.uint8)
            collective(flat)
            sent += flat.numel() * flat.element_size()
            unflatten_into(same_dtype, flat)
    return sent


def unflatten_into(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of `flat` back into `tensors` (the inverse of concatenating them)."""
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        tensor.copy_(flat[offset:offset + count].view_as(tensor))
        offset += count


def average_tensors(tensors: list[torch.Tensor], group=None) -> int:
    """Replace each tensor by its mean over all ranks (in place); return bytes handed over."""
    world = dist.get_world_size(group)

    def mean(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(world)

    return _apply_flat(tensors, mean)


def max_tensors(tensors: list[torch.Tensor], group=None) -> int:
    return _apply_flat(tensors, lambda flat: dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group))


def average_module(module: nn.Module, group=None) -> int:
    """Average parameters and floating buffers across ranks; integer buffers take the max."""
    floating, integer = module_state(module)
    return average_tensors(floating, group) + max_tensors(integer, group)


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0, group=None) -> int:
    """Make every rank's `tensors` equal to rank `src`'s (in place); return bytes handed over."""
    return _apply_flat(tensors, lambda flat: dist.broadcast(flat, src=src, group=group))


def broadcast_module(module: nn.Module, src: int = 0, group=None) -> int:
    """Make every rank's parameters and buffers equal to rank `src`'s."""
    floating, integer = module_state(module)
    return broadcast_tensors(floating + integer, src, group)


def weighted_average_tensors(tensors: list[torch.Tensor], weight: float, group=None) -> int:
    """Replace each tensor by its `weight`-weighted mean over ranks (in place).

    A rank with weight 0 contributes nothing but still receives the result. Returns the bytes
    handed over, the total weight (8 bytes) included."""
    device = tensors[0].device if tensors else torch.device("cpu")
    total = torch.tensor([float(weight)], dtype=torch.float64, device=device)
    dist.all_reduce(total, group=group)
    total_weight = total.item()
    if total_weight <= 0:
        raise ValueError("the weights of all ranks sum to zero")

    def weighted_mean(flat: torch.Tensor) -> None:
        flat.mul_(weight)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(total_weight)

    return tensor_bytes([total]) + _apply_flat(tensors, weighted_mean)


def weighted_average_module(module: nn.Module, weight: float, group=None) -> int:
    """Replace parameters and floating buffers by their `weight`-weighted mean over ranks; integer
    buffers take the max. Returns the bytes handed over (the total weight included)."""
    floating, integer = module_state(module)
    return weighted_average_tensors(floating, weight, group) + max_tensors(integer, group)
