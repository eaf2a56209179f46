"""Is averaging helping? The check of every average, the collapse line, and the guard of a scaled LR.

At every epoch end where the strategy averages (sync, fedavg) or merges (async), each worker
measures loss and accuracy on a fixed probe of its training rows twice: with its own model just
before the average and with the averaged model just after. Strategies whose ranks meet there
sum the numbers over the workers that trained; async's workers judge their own merges.

An average is *bad* when its probe loss is not finite or clearly above the workers' own (by
COLLAPSE_RATIO; sync and fedavg only), when a classifier's accuracy falls to chance (the majority
class's share of the probe) while the workers' own models learned (LEARNED_MARGIN above it), or when its loss is COLLAPSE_RATIO times the best average's
(training goes backwards). Two bad averages in a row are a collapse: one line naming the
epoch, the numbers and the likely fixes, a record in metrics.jsonl, and with --stop-on-collapse
the run stops.

When --lr-scaling auto raised the LR, the same check guards it (LRGuard): at a bad average, or
when the averaged model's probe loss rose by RISE_RATIO over the best previous average, the
replicas go back to the previous average (same on every rank, so no traffic) and the scale is
halved, never below the user's --lr. Scaling can therefore cost at most the epochs it rolls back,
never the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from dptrain.data.sampler import loader
from dptrain.runtime.sharded import gathered, state_holder
from dptrain.train.host_copy import host_copy

PROBE_ROWS = 256  # training rows per worker the check evaluates, twice per average (forward passes only)
PROBE_BYTES = 32 << 20  # the probe is kept in memory, up to this size
COLLAPSE_RATIO = 1.5  # an average is bad when its probe loss is above 1.5x the workers' own
RISE_RATIO = 1.25  # the LR guard also backs off when the average's loss rose 25 % over the best one so far
CHANCE_MARGIN = 0.02  # accuracy within 2 points of the majority class's share is chance
LEARNED_MARGIN = 0.1  # ... where the workers' own models are 10 points above it


@dataclass
class AverageCheck:
    """One average, measured on the probe: the workers' own models against the average."""

    epoch: int
    local_loss: float
    average_loss: float
    local_accuracy: Optional[float]
    average_accuracy: Optional[float]
    chance: Optional[float]
    bad: bool
    why: str = ""  # what made it bad, in words


    def record(self) -> dict:
        return {key: value for key, value in vars(self).items() if key != "epoch"}


def probe_size(train) -> int:
    """PROBE_ROWS, or fewer when so many rows would take more than PROBE_BYTES of memory."""
    x = train[0][0]
    row_bytes = torch.as_tensor(x).numel() * 4 if not isinstance(x, torch.Tensor) else x.numel() * x.element_size()
    return max(16, min(PROBE_ROWS, PROBE_BYTES // max(row_bytes, 1)))


def probe_rows(n_samples: int, rank: int, world: int, seed: int, rows: int = PROBE_ROWS) -> list[int]:
    """This worker's probe: `rows` training rows, disjoint from the other workers' where the data allows,
    fixed for the whole run (reproducible from the seed)."""
    order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed + 0x5EED)).tolist()
    per_worker = max(1, min(rows, n_samples // max(world, 1)))
    start = (rank * per_worker) % max(n_samples - per_worker + 1, 1)
    return sorted(order[start:start + per_worker])


class AverageHealth:
    """Measures each average (see the module's docstring) and says when averaging collapses."""

    def __init__(self, ctx, train, loss_fn: Callable, classify: Optional[bool], together: bool, seed: int,
                 log: Callable[[str], None]) -> None:
        self.ctx, self.loss_fn, self.classify, self.together = ctx, loss_fn, classify, together
        self.log = log
        if getattr(train, "is_stream", False):  # shards: the first samples of the data (dptrain.data.streams)
            self.batches = train.probe(PROBE_ROWS)
        else:
            rows = probe_rows(len(train), ctx.rank, ctx.world_size, seed, probe_size(train))
            with torch.random.fork_rng(devices=[]):  # read once, kept in memory (at most PROBE_BYTES)
                self.batches = list(loader(train, [rows[i:i + 128] for i in range(0, len(rows), 128)]))
        self._local: Optional[torch.Tensor] = None
        self.streak = 0  # bad averages in a row
        self.best_loss = math.inf  # the lowest training loss of an average so far
        self.collapses = 0

    def _measure(self, model: nn.Module) -> torch.Tensor:
        """[loss sum, correct, count, majority count] of `model` on this worker's probe. Forward passes in eval
        mode under a forked RNG (a DataLoader draws a seed): the check changes nothing the run computes. A sharded
        model whole meanwhile (`gathered`: each rank of its group does this check at once), and its shards after."""
        with torch.random.fork_rng(devices=[]), torch.no_grad(), gathered(model):
            return self._totals(model)

    def _totals(self, model: nn.Module) -> torch.Tensor:
        was_training = model.training
        model.eval()
        totals = torch.zeros(4, dtype=torch.float64)
        counts: dict[int, int] = {}
        for x, y in self.batches:
            x, y = x.to(self.ctx.device), y.to(self.ctx.device)
            output = model(x).float()
            totals[0] += self.loss_fn(output, y).item() * len(y)
            classify = self.classify if self.classify is not None else not y.is_floating_point()
            if classify and output.dim() == 2 and y.dim() == 1:
                totals[1] += (output.argmax(dim=1) == y.long()).sum().item()
                for label, count in zip(*torch.unique(y.long().cpu(), return_counts=True)):
                    counts[int(label)] = counts.get(int(label), 0) + int(count)
            else:
                totals[1] = math.nan
            totals[2] += len(y)
        totals[3] = max(counts.values()) if counts else math.nan
        model.train(was_training)
        return totals

    def start(self, model: nn.Module) -> float:
        """The probe loss of the model training starts from (summed over the workers that meet): the first
        'best' an average is compared with, so that an average worse than no training at all is bad too."""
        totals = self._measure(model)
        if self.together and self.ctx.world_size > 1:
            totals = self.ctx.group.sum_tensor("checking the first model", torch.nan_to_num(totals, nan=-1.0))
        self.best_loss = float(totals[0]) / max(float(totals[2]), 1.0)
        return self.best_loss

    def state_dict(self) -> dict:
        """What a checkpoint within an epoch keeps (at an epoch end, start() measures afresh)."""
        return {"streak": self.streak, "best_loss": self.best_loss, "collapses": self.collapses}

    def load_state_dict(self, state: dict) -> None:
        self.streak, self.best_loss, self.collapses = state["streak"], state["best_loss"], state["collapses"]

    def before(self, model: nn.Module, trained: bool) -> None:
        """This worker's own model, just before the average (a worker that sat the round out counts nothing)."""
        self._local = self._measure(model) if trained else torch.zeros(4, dtype=torch.float64)

    def after(self, model: nn.Module, epoch: int, trained: bool) -> AverageCheck:
        """The averaged model on the same rows; the verdict (the same on every rank that meets)."""
        assert self._local is not None, "before() was not called"
        average = self._measure(model) if trained else torch.zeros(4, dtype=torch.float64)
        both = torch.stack([self._local, average])
        if self.together and self.ctx.world_size > 1:
            both = self.ctx.group.sum_tensor("checking the average", torch.nan_to_num(both, nan=-1.0).reshape(-1)).reshape(2, 4)
            both[both < 0] = math.nan  # a regression's accuracy stays undefined
        count = max(float(both[0, 2]), 1.0)
        local_loss, average_loss = float(both[0, 0]) / count, float(both[1, 0]) / count
        accuracies = [float(both[i, 1]) / count for i in range(2)]
        local_accuracy, average_accuracy = [None if math.isnan(a) else a for a in accuracies]
        chance = None if math.isnan(float(both[0, 3])) else float(both[0, 3]) / count
        # Async's merge moves the global model by 1/W of this worker's change: only where the ranks average
        # together is the average comparable with the workers' own models.
        worse = not math.isfinite(average_loss) or (self.together and average_loss > COLLAPSE_RATIO * local_loss)
        at_chance = (chance is not None and average_accuracy is not None and local_accuracy is not None
                     and average_accuracy <= chance + CHANCE_MARGIN and local_accuracy >= chance + LEARNED_MARGIN)
        rose = average_loss > COLLAPSE_RATIO * self.best_loss
        self._local = None
        why = (f"its training loss {average_loss:.4g} against {local_loss:.4g} for the workers' own models" if worse
               else f"its accuracy {average_accuracy:.3f} is at chance ({chance:.3f}) against {local_accuracy:.3f} "
                    "for the workers' own models" if at_chance
               else f"its training loss {average_loss:.4g} is above {COLLAPSE_RATIO:g}x its best, {self.best_loss:.4g}"
               if rose else "")
        self.best_loss = min(self.best_loss, average_loss)
        return AverageCheck(epoch + 1, local_loss, average_loss, local_accuracy, average_accuracy, chance,
                            bool(worse or at_chance or rose), why)

    def verdict(self, check: AverageCheck) -> Optional[str]:
        """The collapse line when this is the second bad average in a row (once per streak), else None."""
        self.streak = self.streak + 1 if check.bad else 0
        if self.streak != 2:
            return None
        self.collapses += 1
        accuracy = (f", accuracy {check.local_accuracy:.3f}; the average's {check.average_accuracy:.3f}, chance "
                    f"{check.chance:.3f}" if check.average_accuracy is not None and check.chance is not None else "")
        return (f"dptrain: averaging collapses: in epoch {check.epoch}, for the second average in a row, the "
                f"averaged model went wrong: {check.why} (workers' own: training loss {check.local_loss:.4g}"
                f"{accuracy}); try --lr-scaling none, a lower --lr, or averaging more often (--sync-every-steps)")


class LRGuard:
    """Backs a scaled LR off towards the user's when averages go wrong, restoring the last good average.

    `scale` is the factor the LR was multiplied by (W for linear); each back-off halves it, down to 1.
    Strategies whose ranks meet restore the previous average (the same tensors on every rank);
    async's workers only lower their own LR (the global model lives with the merge service)."""

    def __init__(self, scale: float, restore: bool, log: Callable[[str], None]) -> None:
        self.scale, self.restore, self.log = scale, restore, log
        self.best_loss = math.inf
        self._good: Optional[dict] = None
        self.backoffs: list[dict] = []

    @property
    def active(self) -> bool:
        return self.scale > 1

    def start(self, model: nn.Module, loss: float) -> None:
        """Training starts (or resumes) from `model`, whose probe loss is `loss`: the first good state."""
        self.best_loss = loss
        self.keep(model)

    def keep(self, model: nn.Module) -> None:
        """Remember `model` (an average judged good) to come back to."""
        if self.restore and self.active:
            # in host memory, its buffers reused (a sharded model's: this rank's shards)
            self._good = host_copy(state_holder(model).state_dict(), into=self._good)

    @property
    def can_recover(self) -> bool:
        """Whether a divergence can be taken back: the LR is still scaled and a good average is kept."""
        return self.active and self.restore and self._good is not None

    def recover(self, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> dict:
        """Training diverged in `epoch` (from 1): back to the last good average, with half the scale."""
        return self._back_off(epoch, "training diverged", model, optimizer, scheduler)

    def judge(self, check: AverageCheck, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> Optional[dict]:
        """After an average: keep it, or back off (halve the scale, restore the last good average)."""
        if not self.active:
            return None
        rose = check.average_loss > RISE_RATIO * self.best_loss
        if not (check.bad or rose):
            self.best_loss = min(self.best_loss, check.average_loss)
            self.keep(model)
            return None
        why = check.why or f"its training loss {check.average_loss:.4g} rose above its best, {self.best_loss:.4g}"
        return self._back_off(check.epoch, "bad average" if check.bad else "average loss rose", model, optimizer,
                              scheduler, f"the averaged model went wrong ({why})")

    def _back_off(self, epoch: int, reason: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                  said: str = "") -> dict:
        """Halve the scale (not below 1) in the optimizer and the schedule; restore the last good average."""
        new_scale = max(1.0, self.scale / 2)
        ratio = new_scale / self.scale
        for group in optimizer.param_groups:
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]
        restored = self.restore and self._good is not None
        if restored:
            state_holder(model).load_state_dict(self._good)
            optimizer.state.clear()  # momentum and moments belonged to the run that went wrong
        event = {"epoch": epoch, "from_scale": self.scale, "to_scale": new_scale, "restored": restored,
                 "reason": reason}
        self.backoffs.append(event)
        self.log(f"dptrain: --lr-scaling auto backs off in epoch {epoch}: {said or reason}; "
                 f"LR scale {self.scale:g} -> {new_scale:g}{', back to the previous average' if restored else ''}")
        self.scale = new_scale
        return event

    def good_state(self) -> dict:
        """The average kept to come back to ({} when none): a checkpoint within an epoch holds it, since the
        model it resumes from is no average (start() would keep it)."""
        return self._good or {}

    def resume(self, best_loss: float, good: dict) -> None:
        """Continue within an epoch: the best loss and the kept average of the checkpoint (good_state())."""
        self.best_loss, self._good = best_loss, (good or None)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "best_loss": self.best_loss, "backoffs": list(self.backoffs)}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.best_loss, self.backoffs = state["scale"], state["best_loss"], list(state["backoffs"])
