"""Compressed averaging of a change (fp16, bf16, int8 with per-block scales) with error feedback.

What is compressed is the *change* a worker made since the last global model, never raw
weights: a change is small and centred on zero, so a per-block int8 scale loses little, and
what rounding drops is not lost but carried into the next average (error feedback):

    v        = change + residual          (residual starts at zero)
    payload  = encode(v)
    residual = v - decode(payload)        (kept on this worker for the next average)

Every rank's payload is all-gathered as raw bytes and every rank decodes all of them in rank
order and forms the same mean (or weighted mean) in float32, so the result is bit-identical on
all ranks and the only rounding is each worker's own, which error feedback carries forward.

Payloads (n elements):
- fp16 / bf16: 2n bytes;
- int8: n bytes of values plus one float32 scale per block of `INT8_BLOCK` elements
  (scale = max|v| / 127 over the block; a block of zeros has scale 0 and decodes to zeros).

`comm_bytes` counts the payload handed to all_gather (this worker's encoded bytes), exactly as an
uncompressed average counts the 4n bytes handed to all_reduce. The wire volume differs by
algorithm: all_gather delivers (W-1) payloads to each rank, a ring all-reduce moves about
2(W-1)/W times its input; so int8 moves fewer bytes on the wire than fp32 up to W = 7 and fp16
up to W = 3 (the cost model uses these wire volumes).
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
    """A worker's residual: what rounding dropped from its last payload, added to its next change."""

    def __init__(self, kind: str, block: int = INT8_BLOCK) -> None:
        if kind not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, not {kind!r}")
        self.kind, self.block = kind, block
        self.residual: Optional[torch.Tensor] = None

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

    def state_dict(self) -> dict:
        return {"kind": self.kind, "residual": self.residual}

    def load_state_dict(self, state: dict) -> None:
        """The residual as saved (checkpoints load on the CPU): it follows the change's device at the next encode."""
        self.residual = state["residual"]


def compressed_mean(change: torch.Tensor, feedback: ErrorFeedback, weight: Optional[float] = None,
                    group: Optional[Group] = None) -> tuple[torch.Tensor, int]:
    """The mean (or `weight`-weighted mean) over ranks of each rank's compressed change.

    Returns (the mean as a flat float32 tensor, identical on every rank; bytes handed over).
    With weights, the weights are all-gathered too (8 bytes each, counted) and a rank with
    weight 0 contributes nothing: it hands over an encoded zero of the same size and keeps its
    residual for the next average it contributes to.
    """
    group = group if group is not None else Group.default()
    flat = change.detach().reshape(-1)
    if weight is not None and float(weight) == 0:
        payload = encode(feedback.kind, torch.zeros_like(flat, dtype=torch.float32), feedback.block)
    else:
        payload = feedback.encode(flat)
    gathered, sent = group.all_gather(payload)
    weights: Sequence[float]
    if weight is None:
        weights = [1.0] * group.world_size
    else:
        mine = torch.tensor([float(weight)], dtype=torch.float64, device=payload.device)
        every, handed = group.all_gather(mine)
        sent += handed
        weights = [float(w.item()) for w in every]
    total = sum(weights)
    if total <= 0:
        raise ValueError("the weights of all ranks sum to zero")
    mean = torch.zeros(flat.numel(), dtype=torch.float32, device=payload.device)
    for rank_weight, rank_payload in zip(weights, gathered):
        if rank_weight:
            mean.add_(decode(feedback.kind, rank_payload, flat.numel(), feedback.block), alpha=rank_weight)
    mean.div_(total)
    return mean, sent
