"""Compressed averaging of a change (fp16, bf16, int8 with per-block scales) with error feedback.

What is compressed is the *change* a worker made since the last global model, never raw
weights: a change is small and centred on zero, so a per-block int8 scale loses little, and
what rounding drops is not lost but carried into the next average (error feedback):

    v        = change + residual          (residual starts at zero)
    payload  = encode(v)
    residual = v - decode(payload)        (kept on this worker for the next average)

The mean is formed in two steps, each rank the "server" of one chunk of the vector (the
DoubleSqueeze scheme of Tang et al. 2019, "DoubleSqueeze: Parallel Stochastic Gradient Descent
with Double-Pass Error-Compensated Compression", with error feedback on both sides):

1. the payload is split into W contiguous chunks (`chunk_bounds`: int8 chunks start on a block of
   `INT8_BLOCK`, so each carries its own scales; sizes differ by at most one block, fp16/bf16 by one
   element; a chunk may be empty when n is small);
2. all_to_all: rank r receives chunk r of every rank's payload, decodes them and forms the mean
   (or weighted mean) of its chunk in float32, in rank order;
3. rank r encodes its mean chunk plus its *server residual* (what the previous encode of its chunk
   dropped) and keeps the new server residual, as a worker keeps its own;
4. all_gather of the encoded mean chunks (each padded to the largest chunk's payload): every rank
   decodes all of them, so the result is bit-identical on every rank.

A rank moves about 2(W-1)/W times the payload on the wire, as a ring all-reduce of the compressed
size does: int8 about 1/4 and fp16/bf16 1/2 of an fp32 ring all-reduce's bytes at every W. The
former scheme (`scheme="all-gather"`: every payload all-gathered, every rank decodes all W) delivers
(W-1) payloads to each rank, so int8 moved more bytes than fp32 from W = 8 on and fp16 from W = 4 on;
it stays selectable for comparison (benchmarks/compression_scaling.py). At W = 2 both move one
payload per rank; the two-step scheme is the default there too, so that an average is the same
computation at every W (a resume or a membership change from 2 workers to more does not change how
the mean is rounded), at the cost of one more collective's latency.

The server residual belongs to this rank's chunk, whose bounds depend on W, on the rank and on n: it
is saved with the worker's residual (ErrorFeedback.state_dict) and restored on a resume with the same
W, and it is reset to zeros whenever W, the rank or n differ from those it was made for (a membership
change, a resume on another number of workers): its rounding, at most one quantisation step of the
mean, is then dropped once.

Payloads (n elements):
- fp16 / bf16: 2n bytes;
- int8: n bytes of values plus one float32 scale per block of `INT8_BLOCK` elements
  (scale = max|v| / 127 over the block; a block of zeros has scale 0 and decodes to zeros).

`comm_bytes` counts what this rank hands to the collectives, as an uncompressed average counts the
4n bytes handed to all_reduce: in the all_to_all the W-1 chunks it addresses to the other ranks
(not its own chunk, which goes to no one), in the all_gather its padded mean chunk, and 8 bytes for
a weight. That is payload_bytes(n) - payload of its own chunk + the largest chunk's payload: the
payload, give or take one chunk's padding. The wire volume of the scheme (the cost model's,
dptrain.costmodel) is that of a ring all-reduce of the payload.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from dptrain.runtime.group import Group

COMPRESSIONS = ("none", "fp16", "bf16", "int8")
INT8_BLOCK = 256
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def payload_bytes(kind: str, numel: int, block: int = INT8_BLOCK) -> int:
    """Bytes of the encoding of `numel` float32 elements."""
    if kind == "none":
        return 4 * numel
    if kind in _HALF:
        return 2 * numel
    if kind == "int8":
        return numel + 4 * math.ceil(numel / block)
    raise ValueError(f"compression must be one of {COMPRESSIONS}, not {kind!r}")


def encode(kind: str, values: torch.Tensor, block: int = INT8_BLOCK) -> torch.Tensor:
    """One flat float32 tensor → its payload as uint8 bytes (on the same device)."""
    values = values.detach().reshape(-1).to(torch.float32)
    if kind == "none":
        return values.clone().view(torch.uint8)
    if kind in _HALF:
        return values.to(_HALF[kind]).view(torch.uint8)
    if kind != "int8":
        raise ValueError(f"compression must be one of {COMPRESSIONS}, not {kind!r}")
    n = values.numel()
    blocks = math.ceil(n / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=values.device)
    padded[:n] = values
    padded = padded.view(blocks, block)
    scales = padded.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantised = torch.round(padded / safe[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
    return torch.cat([scales.view(torch.uint8), quantised.view(torch.uint8)])


def decode(kind: str, payload: torch.Tensor, numel: int, block: int = INT8_BLOCK) -> torch.Tensor:
    """The inverse of encode, up to its rounding: a flat float32 tensor of `numel` elements."""
    if payload.storage_offset() % 4:  # a part of a received buffer (the two-step mean): floats need alignment
        payload = payload.clone()
    if kind == "none":
        return payload.view(torch.float32).clone()
    if kind in _HALF:
        return payload.view(_HALF[kind]).to(torch.float32)
    if kind != "int8":
        raise ValueError(f"compression must be one of {COMPRESSIONS}, not {kind!r}")
    blocks = math.ceil(numel / block)
    scales = payload[:4 * blocks].view(torch.float32)
    quantised = payload[4 * blocks:4 * blocks + numel].view(torch.int8).to(torch.float32)
    return quantised * scales.repeat_interleave(block)[:numel]


class ErrorFeedback:
    """A worker's residual (what rounding dropped from its last payload, added to its next change) and, in
    the two-step mean, its server residual (the same for the mean of the chunk this rank encodes)."""

    def __init__(self, kind: str, block: int = INT8_BLOCK) -> None:
        if kind not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, not {kind!r}")
        self.kind, self.block = kind, block
        self.residual: Optional[torch.Tensor] = None
        self.server: Optional[torch.Tensor] = None
        self.server_for: Optional[tuple[int, int, int]] = None  # (W, rank, n) of the chunk `server` belongs to

    def encode(self, change: torch.Tensor) -> torch.Tensor:
        """Payload of change + residual; the residual becomes what this payload drops."""
        change = change.detach().reshape(-1).to(torch.float32)
        if self.kind == "none":
            return encode("none", change)
        if self.residual is None or self.residual.numel() != change.numel():
            self.residual = torch.zeros_like(change)
        elif self.residual.device != change.device:  # a checkpoint's residual is loaded on the CPU
            self.residual = self.residual.to(change.device)
        corrected = change + self.residual
        payload = encode(self.kind, corrected, self.block)
        self.residual = corrected - decode(self.kind, payload, corrected.numel(), self.block)
        return payload

    def encode_mean(self, mean: torch.Tensor, world: int, rank: int, numel: int) -> torch.Tensor:
        """Payload of this rank's mean chunk + the server residual; the server residual becomes what it drops.
        A server residual made for another (W, rank, n) (a world change) starts again from zeros."""
        if self.kind == "none":
            return encode("none", mean)
        key = (world, rank, numel)
        if self.server is None or self.server_for != key or self.server.numel() != mean.numel():
            self.server, self.server_for = torch.zeros_like(mean), key
        elif self.server.device != mean.device:  # loaded from a checkpoint on the CPU
            self.server = self.server.to(mean.device)
        corrected = mean + self.server
        payload = encode(self.kind, corrected, self.block)
        self.server = corrected - decode(self.kind, payload, corrected.numel(), self.block)
        return payload

    def state_dict(self) -> dict:
        return {"kind": self.kind, "residual": self.residual, "server": self.server,
                "server_for": list(self.server_for) if self.server_for is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """The residuals as saved (checkpoints load on the CPU): they follow the change's device at the next
        encode. A checkpoint from before the two-step mean has no server residual: it starts from zeros."""
        self.residual = state["residual"]
        self.server = state.get("server")
        saved_for = state.get("server_for")
        self.server_for = tuple(int(v) for v in saved_for) if saved_for is not None else None


def chunk_bounds(kind: str, numel: int, world: int, block: int = INT8_BLOCK) -> list[tuple[int, int]]:
    """(start, end) of each rank's chunk of `numel` elements: contiguous, in rank order, int8 chunks made of
    whole blocks of `block` (the last block of the vector may be partial), sizes as even as that allows."""
    unit = block if kind == "int8" else 1
    units = math.ceil(numel / unit)
    each, extra = divmod(units, world)
    edges = [min(numel, unit * (r * each + min(r, extra))) for r in range(world + 1)]
    return list(zip(edges[:-1], edges[1:]))


def split_payload(kind: str, payload: torch.Tensor, numel: int, bounds: Sequence[tuple[int, int]],
                  block: int = INT8_BLOCK) -> list[torch.Tensor]:
    """The payload of `numel` elements cut at block-aligned `bounds`: each part is exactly the payload
    encode() makes of that chunk alone (int8: its blocks' scales, then its values)."""
    if kind != "int8":
        size = payload.numel() // numel if numel else 0
        return [payload[size * start:size * end] for start, end in bounds]
    blocks = math.ceil(numel / block)
    scales, values = payload[:4 * blocks], payload[4 * blocks:]
    parts = []
    for start, end in bounds:
        first = start // block
        last = first + math.ceil((end - start) / block)
        parts.append(torch.cat([scales[4 * first:4 * last], values[start:end]]))
    return parts


SCHEMES = ("two-step", "all-gather")


def _weights(weight: Optional[float], group: Group, device: torch.device) -> tuple[list[float], int]:
    """Every rank's weight (all ones without `weight`) and the bytes handed over for them (8, or 0)."""
    if weight is None:
        return [1.0] * group.world_size, 0
    mine = torch.tensor([float(weight)], dtype=torch.float64, device=device)
    every, handed = group.all_gather(mine)
    weights = [float(w.item()) for w in every]
    if sum(weights) <= 0:
        raise ValueError("the weights of all ranks sum to zero")
    return weights, handed


def _worker_payload(flat: torch.Tensor, feedback: ErrorFeedback, weight: Optional[float]) -> torch.Tensor:
    """This rank's payload: change + residual encoded, or (weight 0) an encoded zero, the residual kept."""
    if weight is not None and float(weight) == 0:
        return encode(feedback.kind, torch.zeros_like(flat, dtype=torch.float32), feedback.block)
    return feedback.encode(flat)


def _weighted_sum(kind: str, weights: Sequence[float], payloads: Sequence[torch.Tensor], numel: int,
                  block: int, device: torch.device) -> torch.Tensor:
    """sum_i weights[i] * decode(payloads[i]) / sum(weights) in float32, in rank order (weight 0 skipped)."""
    mean = torch.zeros(numel, dtype=torch.float32, device=device)
    for rank_weight, rank_payload in zip(weights, payloads):
        if rank_weight:
            mean.add_(decode(kind, rank_payload, numel, block), alpha=rank_weight)
    return mean.div_(sum(weights))


def compressed_mean(change: torch.Tensor, feedback: ErrorFeedback, weight: Optional[float] = None,
                    group: Optional[Group] = None, scheme: str = "two-step") -> tuple[torch.Tensor, int]:
    """The mean (or `weight`-weighted mean) over ranks of each rank's compressed change.

    Returns (the mean as a flat float32 tensor, identical on every rank; bytes handed over).
    With weights, the weights are all-gathered first (8 bytes each, counted) and a rank with
    weight 0 contributes nothing: it hands over an encoded zero of the same size and keeps its
    residual for the next average it contributes to (it still forms and encodes the mean of its chunk).
    `scheme`: "two-step" (the default: all_to_all, mean of a chunk, all_gather; see the module's
    docstring) or "all-gather" (every payload to every rank: (W-1) payloads on the wire per rank).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, not {scheme!r}")
    group = group if group is not None else Group.default()
    flat = change.detach().reshape(-1)
    numel, kind, block = flat.numel(), feedback.kind, feedback.block
    weights, sent = _weights(weight, group, flat.device)
    payload = _worker_payload(flat, feedback, weight)
    if scheme == "all-gather":
        gathered, handed = group.all_gather(payload)
        return _weighted_sum(kind, weights, gathered, numel, block, payload.device), sent + handed
    world, rank = group.world_size, group.rank
    bounds = chunk_bounds(kind, numel, world, block)
    sizes = [payload_bytes(kind, end - start, block) for start, end in bounds]
    parts = split_payload(kind, payload, numel, bounds, block)
    # 2. chunk r of every rank's payload reaches rank r, which forms the mean of its chunk
    received, handed = group.all_to_all(torch.cat(parts), sizes, [sizes[rank]] * world)
    sent += handed
    start, end = bounds[rank]
    mine = _weighted_sum(kind, weights, received.split(sizes[rank]) if sizes[rank] else [received] * world,
                         end - start, block, payload.device)
    # 3. the mean chunk + this rank's server residual, encoded; 4. every rank gets every encoded mean chunk
    encoded = feedback.encode_mean(mine, world, rank, numel)
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=payload.device)
    padded[:encoded.numel()] = encoded
    gathered, handed = group.all_gather(padded)
    sent += handed
    return torch.cat([decode(kind, chunk[:size], chunk_end - chunk_start, block)
                      for chunk, size, (chunk_start, chunk_end) in zip(gathered, sizes, bounds)]), sent
