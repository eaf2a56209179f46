"""Straggler emulation (--slow-worker RANK:FACTOR): a rank whose steps take FACTOR times its own compute.

The delay is measured once, before training, on the rank's own steps without any communication
(dptrain.strategies.auto.measure_compute: the fastest of STEPS steps, the rank's compute when nothing else
on the machine competes; at a job's start the other ranks still import torch and read data on the same
cores, which made a median of 5 steps 80 times too slow once), and is then a fixed sleep per sample. Measured on the
steps of the run instead, it would include the waits for the other ranks (under allreduce the
gradients are synchronised inside the backward pass): with several slowed ranks each would sleep in
proportion to the others' sleeps, and the delays would grow step after step until the live
membership took the waits for lost workers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

from dptrain.strategies.auto import measure_compute

STEPS = 25  # steps timed (after one warm-up): a few milliseconds of a small model's compute


@dataclass(frozen=True)
class StepDelay:
    """What a slowed rank adds to each step: (factor - 1) times its compute, per sample of the batch."""

    factor: float
    compute_per_sample: float  # seconds: this rank's own step, without communication, per sample

    @property
    def per_sample(self) -> float:
        return (self.factor - 1) * self.compute_per_sample

    def seconds(self, samples: int) -> float:
        """The sleep after a step of `samples` samples."""
        return self.per_sample * samples

    def describe(self, rank: int) -> str:
        return (f"dptrain: rank {rank}: --slow-worker {self.factor:g}: its own compute is "
                f"{self.compute_per_sample * 1e3:.6g} ms per sample (measured without communication); each step "
                f"sleeps {self.per_sample * 1e3:.6g} ms per sample more")


def measure_delay(factor: float, step: Callable, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx,
                  batch_size: int, train) -> StepDelay:
    """The delay of a rank slowed by `factor`, its compute timed on `step` (Trainer.timing_step) of `model`,
    which is left as it was; said in one line on this rank's stderr."""
    delay = StepDelay(factor, measure_compute(step, model, optimizer, ctx, batch_size, train, STEPS, min))
    print(delay.describe(ctx.job_rank), file=sys.stderr, flush=True)
    return delay
