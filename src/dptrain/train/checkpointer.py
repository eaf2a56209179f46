"""The checkpointer: when to save, what a rank's state is, and how a run continues from it.

A checkpoint holds every component that changes during training (model, optimizer, LR
schedule, gradient scaler, strategy), the RNG state and the history, so that a resumed run
continues bit for bit. The file format, checksums and pruning live in dptrain.train.checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from dptrain.errors import UserError
from dptrain import faults
from dptrain.runtime.distributed import DistContext
from dptrain.train import checkpoint_files


def load_model_state(model, saved: dict, epoch: int, run_dir: Path) -> None:
    """Load a checkpoint's model state, or say in one line which key or shape does not fit."""
    try:
        model.load_state_dict(saved)
    except RuntimeError as exc:
        raise UserError(f"the checkpoint of epoch {epoch} in '{run_dir}' does not fit this model: "
                        f"{checkpoint_files.first_mismatch(exc)}") from None


class Checkpointer:
    """Saves every `every` epochs into OUT/checkpoints (0: never) and keeps `keep`; restores the newest."""

    def __init__(self, out: Optional[Path], ctx: DistContext, every: int, keep: int,
                 log: Callable[[str], None]) -> None:
        self.out, self.ctx, self.every, self.keep, self.log = out, ctx, every, keep, log

    @property
    def enabled(self) -> bool:
        """Whether this run checkpoints at all (and so whether it can stop early and continue)."""
        return bool(self.every)

    def due(self, epoch: int) -> bool:
        return self.enabled and epoch % self.every == 0

    def save(self, epoch: int, step: int, wall: float, components: dict, history: list[dict]) -> None:
        """This rank's state after `epoch` (from 1); `components` map a name to an object with state_dict() or None."""
        if self.out is None:
            return
        state = {"epoch": epoch, "step": step, "wall_seconds": wall,
                 **{name: (part.state_dict() if part is not None else {}) for name, part in components.items()},
                 "rng": checkpoint_files.rng_state(), "history": history}
        faults.at(self.ctx.rank, epoch)
        faults.point("save-begin")
        checkpoint_files.save(self.out, epoch, self.ctx.rank, state)
        faults.point("save-end")
        faults.at(self.ctx.rank, None)  # other files written later are not part of a save
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
        if epoch is None:
            return None
        state = checkpoint_files.load(self.out, epoch, self.ctx.rank)
        for name, part in components.items():
            if name == "model":
                load_model_state(part, state[name], epoch, self.out)
            elif part is not None and state.get(name):
                part.load_state_dict(state[name])
        checkpoint_files.set_rng_state(state["rng"])
        self.log(f"dptrain: resuming after epoch {epoch} from {self.out}")
        return state


def describe_interruption(out: Optional[Path], world_size: int, epochs_done: int, epochs: int) -> str:
    """One line for a Ctrl-C: how far the run got and what running the same command again does."""
    where = f"after epoch {epochs_done} of {epochs}" if epochs_done else f"during epoch 1 of {epochs}"
    if out is None:
        return f"interrupted {where}"
    saved, _ = checkpoint_files.latest_complete(out, world_size)
    if saved is None:
        return f"interrupted {where}, before any checkpoint; the same command again starts the run over"
    return f"interrupted {where}; the same command again continues from the checkpoint of epoch {saved}"


def epochs_recorded(out: Path) -> int:
    """How many epochs OUT/metrics.jsonl records (a line cut short by a kill does not count)."""
    path = Path(out) / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip().endswith("}"))
