"""Copies of training state kept in host memory, in buffers reused from one copy to the next.

Live membership keeps a rank's state at each epoch start and commit (the last two), and the LR
guard keeps the last good average. Kept on the model's device, that is about two or three more
copies of model, optimizer and strategy state on the GPU (issue 38: a model above about 40 % of
the GPU's memory ran out). `host_copy` puts every tensor of a state in CPU memory instead, pinned
when the source is on a GPU, copied without blocking per tensor and waited for once at the end;
given `into` (a copy no longer needed, of the same structure), it copies into that copy's buffers
rather than allocating new ones, so a run's kept copies are allocated once.

Loading a host copy back (`load_state_dict`) copies its tensors to the model's device, the same way
a checkpoint's tensors, loaded on the CPU, are.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch


def host_copy(tree: Any, into: Any = None) -> Any:
    """`tree` (dicts, lists and tuples of tensors and plain values) with every tensor copied to the CPU:
    into `into`'s tensor at the same place where it has one of the same shape and dtype, into a new one
    otherwise (pinned where the source is on a GPU). Plain values are deep-copied. Returns once every
    copy is done."""
    streams: set = set()
    copied = _copy(tree, into, streams)
    for stream in streams:  # the non-blocking device-to-host copies, waited for once
        stream.synchronize()
    return copied


def tensors(tree: Any):
    """Every tensor in `tree`, depth first."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensors(value)


def _copy(tree: Any, into: Any, streams: set) -> Any:
    if isinstance(tree, torch.Tensor):
        return _tensor(tree, into if isinstance(into, torch.Tensor) else None, streams)
    if isinstance(tree, dict):
        old = into if isinstance(into, dict) else {}
        copied = type(tree)()
        for key, value in tree.items():
            copied[key] = _copy(value, old.get(key), streams)
        if hasattr(tree, "_metadata"):  # a module's state_dict: the versions load_state_dict reads
            copied._metadata = copy.deepcopy(tree._metadata)
        return copied
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        old = into if isinstance(into, (list, tuple)) and len(into) == len(tree) else [None] * len(tree)
        return type(tree)(_copy(value, before, streams) for value, before in zip(tree, old))
    return copy.deepcopy(tree)


def _tensor(source: torch.Tensor, buffer: Optional[torch.Tensor], streams: set) -> torch.Tensor:
    source = source.detach()
    on_gpu = source.device.type == "cuda"
    if (buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype
            or buffer.device.type != "cpu" or buffer.is_pinned() != on_gpu):
        buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=on_gpu)
    buffer.copy_(source, non_blocking=on_gpu)
    if on_gpu:
        streams.add(torch.cuda.current_stream(source.device))
    return buffer
