"""The checkpointer: when to save, what a rank's state is, and how a run continues from it.

A checkpoint holds every component that changes during training (model, optimizer, LR
schedule, gradient scaler, strategy), the RNG state and the history, so that a resumed run
continues bit for bit. A checkpoint within an epoch (every `every_steps` steps) also holds the
position in the epoch (the trainer's `position`: steps done, the epoch's running loss, the checks'
state). The file format, checksums and pruning live in dptrain.train.checkpoint_files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from dptrain.errors import UserError
from dptrain import faults
from dptrain.runtime.distributed import DistContext
from dptrain.train import checkpoint_files


def load_model_state(model, saved: dict, epoch: checkpoint_files.At, run_dir: Path) -> None:
    """Load a checkpoint's model state, or say in one line which key or shape does not fit."""
    try:
        model.load_state_dict(saved)
    except RuntimeError as exc:
        raise UserError(f"the checkpoint of {checkpoint_files.describe(epoch)} in '{run_dir}' does not fit this model: "
                        f"{checkpoint_files.first_mismatch(exc)}") from None


class Checkpointer:
    """Saves every `every` epochs into OUT/checkpoints (0: never), and every `every_steps` steps within an
    epoch (0: never), and keeps `keep`; restores the newest."""

    def __init__(self, out: Optional[Path], ctx: DistContext, every: int, keep: int,
                 log: Callable[[str], None], every_steps: int = 0) -> None:
        self.out, self.ctx, self.every, self.keep, self.log = out, ctx, every, keep, log
        self.every_steps = every_steps

    @property
    def enabled(self) -> bool:
        """Whether this run checkpoints at all (and so whether it can stop early and continue)."""
        return bool(self.every or self.every_steps)

    def due(self, epoch: int) -> bool:
        return bool(self.every) and epoch % self.every == 0

    def due_within(self, steps: int, common: int) -> bool:
        """Whether a checkpoint is due `steps` into an epoch whose every rank takes at least `common` steps
        (the epoch's end, with its averages, is the epoch checkpoint's)."""
        return bool(self.every_steps) and 0 < steps < common and steps % self.every_steps == 0

    def save(self, epoch: int, step: int, wall: float, components: dict, history: list[dict],
             position: Optional[dict] = None) -> None:
        """This rank's state after `epoch` (from 1); `components` map a name to an object with state_dict() or None.

        With `position` (steps > 0 done of epoch `epoch` + 1) it is a checkpoint within that epoch."""
        if self.out is None:
            return
        at = checkpoint_files.named(epoch, position["steps"]) if position else epoch
        state = {"epoch": epoch, "step": step, "wall_seconds": wall,
                 **{name: (part.state_dict() if part is not None else {}) for name, part in components.items()},
                 "rng": checkpoint_files.rng_state(), "history": history, **({"position": position} if position else {})}
        faults.at(self.ctx.job_rank, None if position else epoch)  # the save fault points name epoch ends
        faults.point("save-begin")
        checkpoint_files.save(self.out, at, self.ctx.rank, state)
        faults.point("save-end")
        faults.at(self.ctx.job_rank, None)  # other files written later are not part of a save
        if self.ctx.is_main:
            checkpoint_files.prune(self.out, self.keep, self.ctx.world_size)

    def restore(self, components: dict) -> Optional[dict]:
        """Load the newest complete checkpoint into `components` (rank 0 chooses it for all); its state or None."""
        epoch = None
        if self.ctx.is_main and self.out:
            epoch, notes = checkpoint_files.latest_complete(self.out, self.ctx.world_size)
            for note in notes:
                self.log(f"dptrain: {note}")
        epoch = self.ctx.group.broadcast_object("resume", epoch)
        epoch = tuple(epoch) if isinstance(epoch, list) else epoch  # JSON carries a point within an epoch as a list
        if epoch is None:
            return None
        state = checkpoint_files.load(self.out, epoch, self.ctx.rank)
        for name, part in components.items():
            if name == "model":
                load_model_state(part, state[name], epoch, self.out)
            elif part is not None and state.get(name):
                part.load_state_dict(state[name])
        checkpoint_files.set_rng_state(state["rng"])
        where = f"at {checkpoint_files.describe(epoch)}" if isinstance(epoch, tuple) else f"after epoch {epoch}"
        self.log(f"dptrain: resuming {where} from {self.out}")
        return state


def describe_interruption(out: Optional[Path], world_size: int, epochs_done: int, epochs: int) -> str:
    """One line for a Ctrl-C: how far the run got and what running the same command again does."""
    where = f"after epoch {epochs_done} of {epochs}" if epochs_done else f"during epoch 1 of {epochs}"
    if out is None:
        return f"interrupted {where}"
    saved, _ = checkpoint_files.latest_complete(out, world_size)
    if saved is None:
        return f"interrupted {where}, before any checkpoint; the same command again starts the run over"
    return (f"interrupted {where}; the same command again continues from the checkpoint of "
            f"{checkpoint_files.describe(saved)}")


def epochs_recorded(out: Path) -> int:
    """How many epochs OUT/metrics.jsonl records (a line cut short by a kill does not count)."""
    path = Path(out) / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip().endswith("}"))
