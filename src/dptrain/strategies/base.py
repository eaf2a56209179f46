"""The strategy interface: what a data-parallel strategy communicates, and when.

The Trainer's loop is the same for every strategy; it calls these hooks at fixed points. A
strategy owns all of its communication: the model traffic (setup, after_backward, after_step,
end_epoch, finish) and how ranks agree on bookkeeping (gather_stats, agree_stop,
stop_together, workers_history). The defaults here are for strategies whose ranks meet at every
epoch end; a barrier-free strategy (async) overrides the agreement hooks.
Adding a strategy means adding one file with one subclass, its options and rules (a light module in
dptrain.strategies.rules when the strategy's own imports torch), and registering its name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch
from torch import nn

from dptrain.data.sampler import EpochPlan, shard_plan
from dptrain.errors import UserError
from dptrain.runtime.distributed import DistContext
from dptrain.strategies.rules import StrategyRules

if TYPE_CHECKING:
    from dptrain.runtime.membership import Membership


@dataclass(frozen=True)
class Meeting:
    """Where a strategy's workers meet, declared once per strategy: what the loop, its checks and live
    membership read of it (`Strategy.meets_every_step`, `meets_at_epoch_ends`, `average_check`).

    `at`: "every step" (all of them at each step's all-reduce, and at epoch ends: allreduce), "epoch ends" (all
    of them at every epoch end: sync, fedavg, streaming, hierarchical, local), or "merges" (never all at once:
    each in its merges with rank 0's service, async). `averages_checked`: its epoch-end averages (merges) are
    checked (dptrain.train.health): together where all meet there, by each worker alone in merges."""

    at: str = "epoch ends"
    averages_checked: bool = False

    def __post_init__(self) -> None:
        if self.at not in MEETING_PLACES:
            raise ValueError(f"Meeting.at must be one of {', '.join(MEETING_PLACES)}, not {self.at!r}")


MEETING_PLACES = ("every step", "epoch ends", "merges")


def check_period(every: int, every_steps: Optional[int]) -> None:
    """The averaging period of the periodic strategies: every `every` epochs, or every `every_steps` steps."""
    if every < 1 or (every_steps is not None and every_steps < 1):
        raise ValueError("every and every_steps must be at least 1")


class Strategy(StrategyRules):
    """Base class: no communication at all (each worker trains alone).

    The class-level hooks (`Options`, `check`, `scales_lr`, `check_before_spawn`) come from
    the strategy's rules class in dptrain.strategies.rules, which config validation reads without torch.

    `comm_bytes` counts the payload this worker hands to collectives: the bytes of every
    tensor passed to all_reduce/broadcast (after compression), whatever the algorithm
    underneath moves on the wire. With one worker no strategy communicates.
    """

    name = "local"
    meeting = Meeting()  # where its workers meet (a subclass declares its own)

    @property
    def meets_every_step(self) -> bool:
        """Every worker takes part in a collective at every step (allreduce): live membership may then go on
        from a commit within an epoch (--commit-every-steps), not only from the epoch's start."""
        return self.meeting.at == "every step"

    @property
    def meets_at_epoch_ends(self) -> bool:
        """Every worker stands at each epoch end together (live membership: a lost worker's epoch is redone by
        the others there, and joiners enter there); not async, which hears of a loss in its merges
        (`live_change`) and goes on without going back."""
        return self.meeting.at != "merges"

    @property
    def average_check(self) -> Optional[str]:
        """How the trainer checks the epoch-end averages (dptrain.train.checks): "together" (every rank averages
        at the same epoch ends and sums the check), "alone" (each rank judges its own merges), or None."""
        if not self.meeting.averages_checked:
            return None
        return "alone" if self.meeting.at == "merges" else "together"

    @property
    def final_model_is_last_evaluated(self) -> bool:
        """Whether the last epoch's evaluation (when there was one) is of the model finish() returns; not where
        the global model can still change after a rank's last epoch (merges)."""
        return self.meeting.at != "merges"
    # Whether the run has live membership (--min-workers), and its min_workers: `enable_live`, before setup.
    live = False
    min_workers: Optional[int] = None
    live_unit = 1  # the ranks lost together (a sharded replica group's: dptrain.strategies.sharded)

    def __init__(self) -> None:
        self.comm_bytes = 0
        self._failed = False  # a DDP comm hook saw its all-reduce fail (see note_failure)
        self.ctx: DistContext | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def from_config(cls, config) -> "Strategy":
        """The strategy a TrainConfig asks for (its strategy-specific fields)."""
        return cls()

    def resolve(self, trainer, train) -> "tuple[Strategy, Optional[dict]]":
        """The strategy that trains and a record of how it was chosen, once the process group is up
        (before epoch_plan and setup): itself and None, except for auto, which measures and picks one."""
        return self, None

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> nn.Module:
        """Prepare the model (wrap it, make replicas equal); return the module to train."""
        self.model, self.optimizer, self.ctx = model, optimizer, ctx
        return model

    def shard_as(self, options) -> None:
        """Shard the model inside replica groups (dptrain.strategies.sharded; `options`: a ShardOptions, or None):
        before setup. Only the strategies built for it (Shardable) can; the others refuse anything but none."""
        if options is not None and options.sharded:
            from dptrain.errors import UserError
            from dptrain.strategies.rules.sharding import REFUSED_LINE

            raise UserError(f"--shard {options.shard} is refused with --strategy {self.name}: {REFUSED_LINE}")

    def checkpoint_parts(self, parts: dict) -> dict:
        """What a checkpoint holds of the run's parts (dptrain.train.state.TrainState.parts): themselves; a sharded
        model's strategy, this rank's shards of the model and optimizer."""
        return parts

    def enable_live(self, min_workers: int) -> None:
        """The run has live membership (dptrain.train.live), down to `min_workers` workers: called before setup."""
        self.live, self.min_workers = True, min_workers

    def rebind(self, ctx: DistContext) -> nn.Module:
        """After the run's members changed (--min-workers: a worker was lost, or left at an epoch end):
        `ctx.group` is a new group of the workers left, `ctx.rank` and `ctx.world_size` this rank's place in it,
        and the membership owner (dptrain.train.live) has already set this strategy's state (`load_state_dict`) and the model back to where the
        run goes on from. Drop what this strategy holds of the old group (a DDP wrapper on it, a collective in
        flight) and return the module to train from now on. The default suits a strategy that reaches the
        other ranks only through `ctx.group`, at the moment it communicates."""
        self.ctx, self._failed = ctx, False
        assert self.model is not None, "setup() was not called"
        return self.model

    def live_change(self, epoch: int) -> Optional[Membership]:
        """A strategy that does not meet at epoch ends (`meets_at_epoch_ends` False): the membership the
        workers train in from `epoch` (from 0) on, once, when it changed; the trainer then shares the data out
        again (`epoch_plan`) and the LR rule follows the live world."""
        return None

    def members_now(self) -> Optional[tuple[int, ...]]:
        """A strategy that does not meet at epoch ends: the ranks of the job it merges with now, as this rank
        knows them (they write this rank's checkpoint's manifest); None: the group's."""
        return None

    def after_backward(self, model: nn.Module) -> None:
        """Called after loss.backward(), before the optimizer step (gradients exist)."""

    def after_step(self, step: int) -> None:
        """Called after optimizer.step(); `step` counts steps from 1 over the whole run."""

    def end_epoch(self, epoch: int) -> bool:
        """Called after each epoch (from 0). Return True when the replicas now hold one global model."""
        return self.ctx is None or self.ctx.world_size == 1

    def finish(self) -> nn.Module:
        """The final global model (unwrapped), after any last communication."""
        assert self.model is not None, "setup() was not called"
        return self.model

    def averaging_events(self) -> int:
        """How many averages (merges, rounds) this rank took part in so far: the trainer checks the model
        when end_epoch raised it."""
        return 0

    def restores_average(self) -> bool:
        """Whether the replicas may be set back to an earlier average (the LR guard of --lr-scaling auto)
        without the strategy's own state (an outer optimizer's anchor, compression's error feedback) going stale."""
        return False

    def evaluation_target(self) -> "tuple[nn.Module | None, bool]":
        """(module to evaluate on this rank or None, whether all ranks evaluate it together)."""
        return self.model, True

    def epoch_plan(self, ctx: DistContext, n_samples: int, labels: Callable[[], np.ndarray], batch_size: int,
                   seed: int, shuffle: str, block_size: Optional[int] = None) -> EpochPlan:
        """Which rows this rank reads per epoch: the shared sharding, unless a strategy keeps its own
        (`labels()` reads every sample's label, for partitions by class; `block_size` is the data's)."""
        return shard_plan(n_samples, ctx.rank, ctx.world_size, batch_size, seed, shuffle, block_size)

    def private_plan(self, ctx: DistContext, n_samples: int, batch_size: int, seed: int) -> EpochPlan:
        """Which rows this rank reads per epoch of its own data (a factory taking rank: dptrain.data.private)."""
        raise UserError(f"--strategy {self.name} shares one data set out over the workers; each client's own data "
                        "(a --data factory taking rank) trains under --strategy fedavg")

    def trains_in_epoch(self, epoch: int) -> bool:
        """False when this worker sits out the epoch (e.g. a federated client not sampled this round)."""
        return True

    def communication_failed(self) -> bool:
        """Whether communication inside the backward pass failed (so an error there is a peer's, not the model's)."""
        return self._failed

    def gradient_hook(self, group, count: Callable[[int], None], dtype: Optional[torch.dtype] = None,
                      active: Callable[[], bool] = lambda: True):
        """A DDP communication hook that averages each gradient bucket over `group` (sent as `dtype` when
        given), hands `count` the bytes, and notes a failed all-reduce; while `active()` is false the bucket
        stays this worker's own, with no communication."""
        def hook(state, bucket):
            if not active():
                own: torch.futures.Future = torch.futures.Future()
                own.set_result(bucket.buffer())
                return own
            averaged, sent = group.mean_gradients(bucket.buffer(), dtype)
            count(sent)
            return averaged.then(self.note_failure)
        return hook

    def _add_bytes(self, sent: int) -> None:
        self.comm_bytes += sent

    def note_failure(self, future: torch.futures.Future) -> torch.Tensor:
        """A DDP comm hook's result (chain it with `.then`); remembers when the all-reduce failed, so that
        an error in the backward pass is known as a peer's."""
        try:
            return future.value()
        except Exception:
            self._failed = True
            raise

    # -- agreement between ranks -------------------------------------------------------------
    def gather_stats(self, stats):
        """Every worker's numbers of this epoch, for the live record (all ranks meet here)."""
        gathered = self.ctx.group.gather_objects("metrics", dataclasses.asdict(stats))
        return [type(stats)(**each) for each in gathered]

    def agree_stop(self, requested: Optional[str]) -> Optional[str]:
        """The stop signal this run obeys at this epoch end: one rank's is everyone's."""
        if self.ctx.world_size == 1:
            return requested
        return (requested or "a signal to another rank") if self.ctx.group.any_rank("stop check", bool(requested)) else None

    def stop_together(self) -> None:
        """After this rank's checkpoint: return only once every rank's is on disk (under srun
        --kill-on-bad-exit the first rank to exit with 75 ends the others)."""
        self.ctx.group.any_rank("checkpoint before stopping", True)

    def untrained_shares(self, epochs: int) -> list[tuple[int, int, int]]:
        """After finish: the shares of the data, (epoch from 0, place, members), that no worker's training
        brought into the final model, for the workers left to train now (barrier-free: async)."""
        return []

    def workers_history(self, history: list[dict]) -> Optional[dict[int, list[dict]]]:
        """{epoch: every worker's numbers} when the live records lack them (barrier-free), else None."""
        return None

    def state_dict(self) -> dict:
        """What a checkpoint must hold to continue exactly (tensors, numbers, lists, dicts only)."""
        return {"comm_bytes": self.comm_bytes}

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict() output; called after setup()."""
        self.comm_bytes = state["comm_bytes"]

    def continue_as_copy(self) -> None:
        """After load_state_dict, on a worker new to the run that continues from a copy of another's state
        (a resume on more workers): what that one counted (its bytes) stays that one's."""
        self.comm_bytes = 0

    def refuses_other_world(self, within_epoch: bool) -> Optional[str]:
        """`other_world_refused` for this strategy as it was built (its settings as `describe` says them)."""
        return self.other_world_refused(SimpleNamespace(**self.describe()), within_epoch)

    def summary(self) -> dict:
        """Strategy-specific results for summary.json (after finish)."""
        return {}

    def describe(self) -> dict:
        """Strategy settings for summaries."""
        return {"name": self.name}
