"""One training step: forward in the run's precision, the loss, backward with the strategy's hook, clip, step.

The trainer's loop calls `Stepper.step` once a batch; `timing_step` is the same step without
communication, loss scaling or clipping, which --strategy auto times before it chooses.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Union

import torch
from torch import nn

from dptrain.errors import UserError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_loss(loss: Union[str, LossFn]) -> LossFn:
    if callable(loss):
        return loss
    # Targets are cast to what the loss needs (a no-op when they already are): float labels of a
    # classification (--task classify; soft (n, C) targets stay as they are), integer targets of a
    # regression (--task regress).
    if loss == "cross-entropy":
        cross_entropy = nn.CrossEntropyLoss()
        return lambda output, target: cross_entropy(output, target.long() if target.dim() == 1 else target)
    if loss == "mse":
        mse = nn.MSELoss()
        return lambda output, target: mse(output, target.float().reshape(output.shape))
    raise ValueError(f"unknown loss {loss!r}: use 'cross-entropy', 'mse' or a callable")


def check_amp(amp: str, device: torch.device) -> None:
    if amp == "fp16" and device.type != "cuda":
        raise UserError("--amp fp16 needs a GPU; on the CPU use --amp bf16 or none")


def timing_step(device: torch.device, amp: str, loss_fn: LossFn, model: nn.Module,
                optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One plain step of `model` with `optimizer` on (x, y) in precision `amp`, without communication, loss
    scaling or clipping: what --strategy auto times (dptrain.strategies.auto)."""
    inputs, targets = x.to(device), y.to(device)
    dtype = AMP_DTYPES[amp]
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        loss = loss_fn(model(inputs).float(), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class Stepper:
    """The step of one run: its context, loss, precision, loss scaler, clipping and the strategy it trains with."""

    def __init__(self, ctx, loss_fn: LossFn, amp: str, grad_clip: Optional[float],
                 optimizer: torch.optim.Optimizer, accumulate: int = 1) -> None:
        self.ctx, self.loss_fn, self.amp, self.grad_clip, self.optimizer = ctx, loss_fn, amp, grad_clip, optimizer
        self.accumulate = accumulate  # a step's batch holds this many micro-batches (gradient accumulation)
        self.scaler: Optional[torch.amp.GradScaler] = torch.amp.GradScaler("cuda") if amp == "fp16" else None
        self.strategy = None  # set once the strategy is known (after --strategy auto chose)
        self._forward_mark: Optional[tuple] = None  # (the DDP model, its forward pre-hook) for `forward`
        self._in_user_forward = False

    def step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the batch (x, y). With `accumulate` N, the batch is N micro-batches (the last
        may be short), each forward and backward in turn with its loss weighted by its share of the batch, so
        the gradient is the batch's mean, as one backward of the whole batch would give; under DDP only the
        last backward communicates (no_sync before it). Returns the batch's loss."""
        device = self.ctx.device
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        parts = max(1, min(self.accumulate, len(x)))
        size = -(-len(x) // parts)
        chunks = list(zip(x.split(size), y.split(size)))
        total = None
        for index, (part_x, part_y) in enumerate(chunks):
            share = len(part_x) / len(x) if len(chunks) > 1 else 1.0
            quiet = model.no_sync() if index < len(chunks) - 1 and isinstance(model, nn.parallel.DistributedDataParallel) \
                else contextlib.nullcontext()
            with quiet:
                loss = self._backward(model, part_x, part_y, share)
            total = loss if len(chunks) == 1 else loss * share + (total if total is not None else 0.0)
        self.strategy.after_backward(model)
        if self.grad_clip is not None:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), self.grad_clip)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total.detach()

    def _backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, share: float) -> torch.Tensor:
        """Forward and backward of (x, y), its loss weighted by `share` in the gradient; returns the loss."""
        dtype = AMP_DTYPES[self.amp]
        with torch.autocast(self.ctx.device.type, dtype=dtype) if dtype else contextlib.nullcontext():
            output = self.forward(model, x)
            loss = self.loss_fn(output.float(), y)
        weighted = loss * share if share != 1.0 else loss
        scaled = self.scaler.scale(weighted) if self.scaler else weighted
        self.ctx.group.bounded("backward", scaled.backward, communication_failed=self.strategy.communication_failed)
        return loss.detach()

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`model(x)`. DistributedDataParallel communicates before it calls the user's module (the bucket
        order after the first step, buffers): an error raised before the user's forward was entered is a
        peer's (one line naming it), one raised inside it keeps its traceback."""
        if not isinstance(model, nn.parallel.DistributedDataParallel):  # a DistError there: a sharded model's peer's
            return self.ctx.group.bounded("forward", lambda: model(x), communication_failed=False)
        if self._forward_mark is None or self._forward_mark[0] is not model:
            self.forget_model()
            self._forward_mark = (model, model.module.register_forward_pre_hook(self._entered_forward))
        self._in_user_forward = False
        return self.ctx.group.bounded("forward", lambda: model(x), communication_failed=lambda: not self._in_user_forward)

    def forget_model(self) -> None:
        """Drop the hook on the module trained so far (nothing may keep an old group's DDP alive)."""
        if self._forward_mark is not None:
            self._forward_mark[1].remove()
            self._forward_mark = None

    def _entered_forward(self, module: nn.Module, inputs) -> None:
        self._in_user_forward = True
