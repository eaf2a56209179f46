"""The state of one training run, typed: what trains, where the run stands, and the options it was given.

`TrainState` is what the loop carries from step to step and what a checkpoint, a commit or a
joiner's heal holds: model, optimizer, schedule, loss scaler, strategy, the checks around the
averages (dptrain.train.checks), the epoch and step, and the position within the epoch.
The option groups are what `dptrain.Trainer` is given, by concern (its keyword arguments of
old still work: `options_from`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Callable, Optional

import torch
from torch import nn

from dptrain.data.sampler import Rest
from dptrain.errors import UserValueError
from dptrain.strategies.rules.sharding import ShardOptions
from dptrain.train import checkpoint_files
from dptrain.train.host_copy import host_copy


@dataclass
class Position:
    """Where within an epoch a run stands: `steps` of it done, the `samples` read and their `loss_sum`, the
    `seconds` it took so far; a checkpoint's also what the checks kept (`checks`) and how the epoch was shared out
    over the workers (`plan`, dptrain.train.planner.Planner.lineage), a commit's and a resume's the random state
    to go on with (`rng`)."""

    steps: int
    samples: int
    loss_sum: torch.Tensor
    seconds: float
    rng: Optional[dict] = None
    checks: dict = field(default_factory=dict)
    plan: Optional[list] = None

    def saved(self) -> dict:
        """The position as a checkpoint file holds it."""
        return {"steps": self.steps, "samples": self.samples, "loss_sum": self.loss_sum, "seconds": self.seconds,
                **self.checks, **({"plan": self.plan} if self.plan is not None else {})}

    @classmethod
    def from_saved(cls, saved: dict, rng: dict) -> "Position":
        return cls(saved["steps"], saved["samples"], saved["loss_sum"], saved["seconds"], rng,
                   {"health": saved["health"], "lr_guard": saved["lr_guard"]})


@dataclass
class TrainState:
    """One rank's training state. `module` is what trains (the strategy's wrapping of `model`); `rest` the rest
    of an epoch shared out again over the workers (after a commit, or a resume on another number of workers)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    strategy: object
    checks: object
    scheduler: Optional[object] = None
    scaler: Optional[torch.amp.GradScaler] = None
    module: Optional[nn.Module] = None
    epoch: int = 0
    step: int = 0
    position: Optional[Position] = None
    rest: Optional[Rest] = None

    def parts(self) -> dict:
        """The parts whose state_dict a checkpoint holds, by name."""
        parts = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                 "scaler": self.scaler, "strategy": self.strategy}
        if self.checks.lr_guard is not None:
            parts["lr_guard"] = self.checks.lr_guard
        return self.strategy.checkpoint_parts(parts)

    def snapshot(self, history: list[dict], position: Optional[Position] = None, into: Optional[dict] = None,
                 host: bool = True) -> dict:
        """This rank's state now, in host memory (what a checkpoint holds), to return to after a membership
        change; `position`: where within the epoch it stands (a commit's); `into`: a snapshot no longer needed,
        whose buffers this one reuses (dptrain.train.host_copy). `host=False`: the state_dicts' own tensors
        where they are (to send them on at once, healing a joiner), no copy."""
        parts = {name: part.state_dict() for name, part in self.parts().items() if part is not None}
        return {"step": self.step, "rng": checkpoint_files.rng_state(), "history": list(history),
                "position": position, **(host_copy(parts, into) if host else parts)}

    def load(self, saved: dict) -> None:
        """Back to a `snapshot` (its random state too)."""
        for name, part in self.parts().items():
            if part is not None:
                part.load_state_dict(copy.deepcopy(saved[name]))
        checkpoint_files.set_rng_state(saved["rng"])
        self.step, self.position = saved["step"], saved["position"]


# -- the options of a run, by concern ------------------------------------------------------------
@dataclass
class RunOptions:
    """Where the run writes and what it says: OUT's files, lines and progress bars, the loggers; the device,
    the wait on another worker, the seed, the shuffle, the data loader's processes."""

    out: Optional[str] = None
    progress: bool = True
    verbose: bool = True
    device: str = "auto"
    timeout: float = 300.0
    seed: int = 0
    shuffle: str = "global"
    loader_workers: int = 0
    tensorboard: bool = False  # TensorBoard events in OUT/tensorboard as each epoch ends (dptrain.train.loggers)
    log_to: tuple = ()  # also "mlflow", "wandb"


@dataclass
class StepOptions:
    """How each step trains: the batch (`accumulate` batches of `batch_size` per step), the LR schedule, the
    precision, gradient clipping."""

    batch_size: int = 32
    accumulate: int = 1  # an optimizer step every N batches of batch_size (gradient accumulation)
    schedule: Optional[Callable] = None
    amp: str = "none"
    grad_clip: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "accumulate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserValueError(f"{name} must be a whole number of at least 1, not {value!r}")


@dataclass
class CheckpointOptions:
    """Checkpoints every `every` epochs and every `every_steps` steps within one, the newest `keep` kept; `resume`
    from the newest (`resume_with_changed_data`: although the data's fingerprint differs)."""

    every: int = 0
    every_steps: int = 0
    keep: int = 2
    resume: bool = False
    resume_with_changed_data: bool = False
    monitor: Optional[str] = None  # test_loss or test_accuracy: OUT/best.pt (dptrain.train.best)
    early_stop_patience: Optional[int] = None  # stop after N evaluated epochs without a better monitored value


@dataclass
class CheckOptions:
    """The check of every average (`check_averages`), stopping when averaging collapses, and the factor
    --lr-scaling auto multiplied the LR by (`lr_scale`: the guard backs it off when averages go wrong)."""

    check_averages: bool = True
    stop_on_collapse: bool = False
    lr_scale: float = 1.0


@dataclass
class MembershipOptions:
    """Live membership (dptrain.train.live): with `min_workers`, the run goes on without lost workers down to
    that many, and joiners enter while fewer than `max_workers` train; `lr_rule(W)` the factor of the LR rule for
    W workers; `commit_every_steps`: where the workers left go on from within an epoch (allreduce)."""

    min_workers: Optional[int] = None
    max_workers: Optional[int] = None
    lr_rule: Optional[Callable[[int], float]] = None
    commit_every_steps: int = 0

    def __post_init__(self) -> None:
        if self.max_workers is not None and self.min_workers is None:
            raise ValueError("max_workers needs min_workers: workers enter a run whose membership changes")
        if self.commit_every_steps and self.min_workers is None:
            raise ValueError("commit_every_steps needs min_workers: the commits are where the workers left go on from")
        if self.commit_every_steps < 0:
            raise ValueError(f"commit_every_steps must be 1 or more (0: none), not {self.commit_every_steps}")


# The Trainer's keyword arguments of old: keyword -> (option group, its field).
GROUPS = {"run": RunOptions, "step": StepOptions, "checkpoints": CheckpointOptions, "checks": CheckOptions,
          "membership": MembershipOptions, "sharding": ShardOptions}
_RENAMED = {("checkpoints", "every"): "checkpoint_every", ("checkpoints", "every_steps"): "checkpoint_every_steps",
            ("checkpoints", "keep"): "keep_checkpoints"}
KEYWORDS = {_RENAMED.get((group, each.name), each.name): (group, each.name)
            for group, kind in GROUPS.items() for each in fields(kind)}


def options_from(given: dict, keywords: dict) -> dict:
    """The option groups of a Trainer: those `given` (by group name, or None), each completed from the old
    keyword arguments `keywords` (e.g. batch_size=64, min_workers=2). An unknown keyword is a TypeError, as
    Python's own for a function's."""
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"Trainer() got an unexpected keyword argument {unknown[0]!r}")
    values: dict[str, dict] = {group: {} for group in GROUPS}
    for keyword, value in keywords.items():
        group, name = KEYWORDS[keyword]
        if given.get(group) is not None:
            raise TypeError(f"Trainer() got both {group}= and {keyword}=: give {keyword} in {group} only")
        values[group][name] = value
    return {group: given.get(group) or kind(**values[group]) for group, kind in GROUPS.items()}
