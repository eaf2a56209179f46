"""allreduce: gradients averaged across workers every step, by DistributedDataParallel.

DDP does the bucketing and overlaps communication with the backward pass; our hook hands each
bucket to the run's Group (`mean_gradients`: as it is, or cast to fp16 or bf16) and counts the bytes.
With --min-workers, a new DDP is made on the workers left after a membership change (`rebind`).
"""

from __future__ import annotations

import torch
from torch import nn

from dptrain.runtime.distributed import DistContext
from dptrain.strategies.base import Meeting, Strategy
from dptrain.strategies.collectives import module_state, tensor_bytes
from dptrain.strategies.rules.allreduce import AllReduceRules
from dptrain.strategies.sharded import Shardable

# What the gradients travel as: float32 as they are, or cast to half precision (divided first, as
# torch's fp16/bf16_compress_hook do).
GRADIENT_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class AllReduce(Shardable, AllReduceRules, Strategy):
    """Per-step gradient all-reduce (the Horovod/DDP way): after k steps every replica equals
    single-process training on the union of the workers' batches. With a sharded model (`shard_as`), FSDP2
    inside each replica group and each gradient shard all-reduced across the groups (HSDP)."""

    name = "allreduce"
    gradients_across = True  # sharded: each step's gradient shards all-reduced across the replica groups (HSDP)
    meeting = Meeting("every step")  # live membership can go on from a commit within an epoch (--commit-every-steps)

    def __init__(self, compression: str = "none", bucket_cap_mb: float = 25.0) -> None:
        super().__init__()
        if compression not in GRADIENT_DTYPES:
            raise ValueError(f"compression must be one of {sorted(GRADIENT_DTYPES)}, not {compression!r}")
        self.compression = compression
        self.bucket_cap_mb = bucket_cap_mb
        self._buffer_bytes = 0

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        super().setup(model, optimizer, ctx)
        if self.shard_options is not None:
            return self._shard_setup(model, optimizer, ctx, average_gradients=True)
        if ctx.world_size == 1:
            return model
        floating, integer = module_state(model)
        # DDP's constructor broadcasts rank 0's parameters and buffers; DDP re-broadcasts the
        # buffers (BatchNorm statistics) from rank 0 before every forward in training.
        self.comm_bytes += tensor_bytes(floating + integer)
        return self._wrap(ctx, init_sync=True)

    def _wrap(self, ctx: DistContext, init_sync: bool) -> nn.Module:
        """The model under DistributedDataParallel on `ctx.group`, its gradient buckets averaged by our hook."""
        self._buffer_bytes = tensor_bytes(self.model.buffers())
        ddp = ctx.group.data_parallel(self.model, bucket_cap_mb=self.bucket_cap_mb, init_sync=init_sync)
        dtype = GRADIENT_DTYPES[self.compression]

        ddp.register_comm_hook(state=None, hook=self.gradient_hook(ctx.group, self._add_bytes, dtype))
        return ddp

    def rebind(self, ctx: DistContext) -> nn.Module:
        """A new DDP on the new group (the old one's all-reduces went to the old members). Its constructor
        broadcasts nothing: the workers left hold the same weights already (every replica is the same model
        at every step, and the trainer set each back to the same epoch start); the buffers go from the new
        rank 0 before its first forward, as before every forward. Alone, the model trains unwrapped."""
        model = super().rebind(ctx)
        if self.shard_options is not None:  # FSDP goes on in each replica group left (Shardable.rebind)
            return model
        if ctx.world_size == 1:
            self._buffer_bytes = 0
            return model
        return self._wrap(ctx, init_sync=False)

    @classmethod
    def from_config(cls, config) -> "AllReduce":
        return cls(compression=config.compression)

    def after_step(self, step: int) -> None:
        self.comm_bytes += self._buffer_bytes

    def end_epoch(self, epoch: int) -> bool:
        return True

    def describe(self) -> dict:
        return {"name": self.name, "compression": self.compression, **self.sharding()}
