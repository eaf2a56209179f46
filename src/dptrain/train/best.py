"""The best model by a test metric (`--monitor`) and early stopping (`--early-stop-patience`), as Lightning's
ModelCheckpoint(monitor=...) and EarlyStopping do.

After each evaluated epoch the metric of the global model (`test_loss`: lower is better; `test_accuracy`:
higher) is compared with the best so far, read from the run's history (what every rank keeps and every
checkpoint holds, so a resumed run goes on with the same best and the same count). An epoch that beats
it (strictly) writes OUT/best.pt, the evaluated model's state_dict on the CPU (a sharded model's gathered, as
model.pt is), and OUT/best.json (epoch, metric, value). With a patience of N, the run stops after N evaluated epochs in a row without a better
value: rank 0 decides and says so, every rank stops after the same epoch, and the run ends as a finished
one (model.pt is the last epoch's model, best.pt the best). Epochs that were not evaluated (an average
every few epochs) count for nothing. Early stopping needs a strategy whose workers meet at every epoch end.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Callable, Optional

from dptrain.errors import UserError
from dptrain.io import save_torch, write_json
from dptrain.runtime.sharded import full_state

MONITORS = {"test_loss": operator.lt, "test_accuracy": operator.gt}  # metric -> "strictly better than"


class Best:
    """What --monitor and --early-stop-patience ask of one run (nothing, where neither is given)."""

    def __init__(self, out: Optional[Path], ctx, metric: Optional[str], patience: Optional[int],
                 log: Callable[[str], None]) -> None:
        if patience is not None and metric is None:
            metric = "test_loss"
        if metric is not None and metric not in MONITORS:
            raise UserError(f"monitor {metric!r} must be one of {', '.join(MONITORS)}")
        if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
            raise UserError(f"early_stop_patience must be a whole number of at least 1, not {patience!r}")
        self.out, self.ctx, self.metric, self.patience, self.log = out, ctx, metric, patience, log

    def check_strategy(self, strategy) -> None:
        if self.patience is not None and not strategy.meets_at_epoch_ends:
            raise UserError(f"early stopping needs workers that meet at every epoch end, and {strategy.name} has "
                            "none (each merges on its own): drop --early-stop-patience (--monitor still keeps the "
                            "best model)")

    def best(self, history: list[dict]) -> tuple[Optional[int], Optional[float], int]:
        """(epoch of the best value, the value, evaluated epochs since it) over `history`."""
        better = MONITORS[self.metric]
        best_epoch, best_value, since = None, None, 0
        for record in history:
            value = record.get(self.metric)
            if not record.get("evaluated", value is not None) or value is None:
                continue
            if best_value is None or better(value, best_value):
                best_epoch, best_value, since = record["epoch"], value, 0
            else:
                since += 1
        return best_epoch, best_value, since

    def epoch_ended(self, history: list[dict], strategy) -> bool:
        """After the epoch just recorded (the last of `history`): best.pt where it is the best; whether the run
        stops early here (the same answer on every rank)."""
        if self.metric is None or not history:
            return False
        epoch, value, since = self.best(history)
        if epoch is not None and epoch == history[-1]["epoch"] and self.out:  # every rank: a sharded model is
            model, _ = strategy.evaluation_target()                           # gathered from all of them
            state = full_state(model, wanted=self.ctx.writes_results)
            if self.ctx.writes_results:
                save_torch(self.out / "best.pt", state)
                write_json(self.out / "best.json", {"epoch": epoch, "metric": self.metric, "value": value})
        stop = self.patience is not None and epoch is not None and since >= self.patience
        if self.patience is not None and self.ctx.world_size > 1:  # rank 0's word: one decision for the run
            stop = bool(self.ctx.group.broadcast_object("early stopping", stop))
        if stop:
            where = f"; its model in {self.out / 'best.pt'}" if self.out else ""
            self.log(f"dptrain: stopping early after epoch {history[-1]['epoch']}: {self.metric} has not improved "
                     f"for {self.patience} evaluated epoch{'s' if self.patience > 1 else ''} (--early-stop-patience "
                     f"{self.patience}); the best, {value:.4f}, was epoch {epoch}'s{where}")
        return stop
