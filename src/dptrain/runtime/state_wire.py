"""A training state sent from one rank to the others as tensors (healing a worker that joins).

A state is a tree of dicts, lists and tuples holding tensors and plain values (what `state_dict()`s
return). It travels in two parts:

- its *structure*: the tree with every tensor replaced by `{MARK: i}`, and each tensor's dtype, shape
  and whether it lives on the CPU, saved with torch.save and read back with `weights_only=True`, so
  a peer's bytes that would run code when unpickled are refused and nothing of them runs;
- its *tensors*: their raw bytes, laid end to end (each at a multiple of `ALIGN` bytes) in buckets
  of at most `BUCKET_BYTES`, each bucket one broadcast of a uint8 tensor on the collective device
  (the GPU under NCCL): no pickled blob of the whole state, and no copy of it larger than a bucket.

A tensor larger than a bucket has a bucket of its own. The sender packs each bucket from its tensors
where they are (the model's device) and a receiver makes its tensors from the bucket on the device the
caller names (or on the CPU, where the sender's was): the bytes are taken as they come, the dtypes
and shapes are the structure's, checked against the bucket sizes both sides compute from it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

MARK = "__dptrain_tensor__"
ALIGN = 16  # every tensor starts at a multiple of 16 bytes of its bucket, so a bucket's slice views as any dtype
BUCKET_BYTES = 32 << 20


@dataclass(frozen=True)
class Spec:
    """What a receiver needs to make one tensor from bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    on_cpu: bool

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    size: int  # bytes
    parts: tuple[tuple[int, int], ...]  # (tensor index, offset in the bucket)


def split(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """(`tree` with each tensor replaced by {MARK: its index}, the tensors in that order)."""
    found: list[torch.Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise ValueError(f"a {value.layout} tensor cannot be sent as bytes")
            found.append(value.detach())
            return {MARK: len(found) - 1}
        if isinstance(value, dict):
            out = type(value)()
            for key, item in value.items():
                out[key] = walk(item)
            if hasattr(value, "_metadata"):  # a module's state_dict: the versions load_state_dict reads
                out._metadata = value._metadata
            return out
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(walk(item) for item in value)
        return value

    return walk(tree), found


def join(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of `split`."""

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if len(value) == 1 and MARK in value:
                return tensors[value[MARK]]
            out = type(value)()
            for key, item in value.items():
                out[key] = walk(item)
            if hasattr(value, "_metadata"):
                out._metadata = value._metadata
            return out
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(walk(item) for item in value)
        return value

    return walk(skeleton)


def header(skeleton: Any, tensors: list[torch.Tensor]) -> bytes:
    """The structure's bytes: the skeleton and, per tensor, [dtype name, shape, on the CPU]."""
    specs = [[str(t.dtype).removeprefix("torch."), list(t.shape), t.device.type == "cpu"] for t in tensors]
    buffer = io.BytesIO()
    torch.save({"tree": skeleton, "tensors": specs}, buffer)
    return buffer.getvalue()


def read_header(data: bytes, refuse: Callable[[str], Exception]) -> tuple[Any, list[Spec]]:
    """(skeleton, specs) from `header`'s bytes, read as tensors and plain values only; anything else raises
    `refuse(why)` and nothing of it runs."""
    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes are, they are not a structure dptrain sent
        raise refuse(str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__) from None
    if not isinstance(loaded, dict) or set(loaded) != {"tree", "tensors"} or not isinstance(loaded["tensors"], list):
        raise refuse(f"a {type(loaded).__name__} without the structure's tree and tensors")
    specs = []
    for entry in loaded["tensors"]:
        dtype = getattr(torch, entry[0], None) if isinstance(entry, list) and len(entry) == 3 \
            and isinstance(entry[0], str) else None
        if not isinstance(dtype, torch.dtype) or not isinstance(entry[1], list) \
                or not all(isinstance(n, int) and n >= 0 for n in entry[1]) or not isinstance(entry[2], bool):
            raise refuse(f"a tensor described as {str(entry)[:80]}, not [dtype, shape, on the CPU]")
        specs.append(Spec(dtype, tuple(entry[1]), entry[2]))
    marks = [False] * len(specs)

    def check(value: Any) -> None:  # every mark names a tensor described, once
        if isinstance(value, dict):
            if MARK in value:
                index = value[MARK]
                if len(value) != 1 or not isinstance(index, int) or not 0 <= index < len(specs) or marks[index]:
                    raise refuse(f"a tensor mark {str(value)[:80]} that names no tensor described")
                marks[index] = True
                return
            for item in value.values():
                check(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                check(item)

    check(loaded["tree"])
    if not all(marks):
        raise refuse(f"{marks.count(False)} tensors described that the tree does not hold")
    return loaded["tree"], specs


def buckets(specs: list[Spec], limit: int = BUCKET_BYTES) -> list[Bucket]:
    """The tensors in order, each at a multiple of ALIGN, in buckets of at most `limit` bytes (a larger tensor
    alone in one): what sender and receivers both compute from the structure."""
    out: list[Bucket] = []
    parts: list[tuple[int, int]] = []
    size = 0
    for index, spec in enumerate(specs):
        start = -(-size // ALIGN) * ALIGN
        if parts and start + spec.nbytes > limit:
            out.append(Bucket(size, tuple(parts)))
            parts, start = [], 0
        parts.append((index, start))
        size = start + spec.nbytes
    if parts:
        out.append(Bucket(size, tuple(parts)))
    return out


def pack(bucket: Bucket, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bucket's bytes on `device`, copied from its tensors where they are."""
    data = torch.empty(bucket.size, dtype=torch.uint8, device=device)
    for index, offset in bucket.parts:
        source = tensors[index].contiguous().reshape(-1).view(torch.uint8)
        data[offset:offset + source.numel()].copy_(source)
    return data


def unpack(bucket: Bucket, data: torch.Tensor, specs: list[Spec], device: Optional[torch.device],
           into: dict[int, torch.Tensor]) -> None:
    """The bucket's tensors, each a copy of its bytes on `device` (on the CPU where the sender's was)."""
    for index, offset in bucket.parts:
        spec = specs[index]
        view = data[offset:offset + spec.nbytes].view(spec.dtype).reshape(spec.shape)
        target = torch.device("cpu") if spec.on_cpu or device is None else device
        into[index] = view.to(target, copy=True)
