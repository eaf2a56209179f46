"""allreduce: gradients averaged across workers every step, by DistributedDataParallel.

DDP does the bucketing and overlaps communication with the backward pass; we only choose
the communication hook (plain, fp16- or bf16-compressed) and count what it hands over.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dptrain.runtime.distributed import DistContext
from dptrain.strategies.base import Strategy
from dptrain.strategies.collectives import module_state, tensor_bytes
from dptrain.strategies.rules.allreduce import AllReduceRules

HOOKS = {
    "none": (default_hooks.allreduce_hook, None),
    "fp16": (default_hooks.fp16_compress_hook, 2),
    "bf16": (default_hooks.bf16_compress_hook, 2),
}


class AllReduce(AllReduceRules, Strategy):
    """Per-step gradient all-reduce (the Horovod/DDP way): after k steps every replica equals
    single-process training on the union of the workers' batches."""

    name = "allreduce"

    def __init__(self, compression: str = "none", bucket_cap_mb: float = 25.0) -> None:
        super().__init__()
        if compression not in HOOKS:
            raise ValueError(f"compression must be one of {sorted(HOOKS)}, not {compression!r}")
        self.compression = compression
        self.bucket_cap_mb = bucket_cap_mb
        self._buffer_bytes = 0

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        super().setup(model, optimizer, ctx)
        if ctx.world_size == 1:
            return model
        floating, integer = module_state(model)
        # DDP's constructor broadcasts rank 0's parameters and buffers; DDP re-broadcasts the
        # buffers (BatchNorm statistics) from rank 0 before every forward in training.
        self.comm_bytes += tensor_bytes(floating + integer)
        self._buffer_bytes = tensor_bytes(model.buffers())
        ddp = ctx.group.data_parallel(model, bucket_cap_mb=self.bucket_cap_mb)
        hook, compressed_size = HOOKS[self.compression]

        def counting_hook(state, bucket):
            grads = bucket.buffer()
            self.comm_bytes += grads.numel() * (compressed_size or grads.element_size())
            return hook(state, bucket).then(self.note_failure)

        ddp.register_comm_hook(state=ctx.group.handle, hook=counting_hook)
        return ddp

    @classmethod
    def from_config(cls, config) -> "AllReduce":
        return cls(compression=config.compression)

    def after_step(self, step: int) -> None:
        self.comm_bytes += self._buffer_bytes

    def end_epoch(self, epoch: int) -> bool:
        return True

    def describe(self) -> dict:
        return {"name": self.name, "compression": self.compression}
