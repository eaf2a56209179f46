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

import torch

from dptrain.errors import UserError
from dptrain import faults
from dptrain.runtime.distributed import DistContext
from dptrain.strategies.rules import RESUME_ON_ANY_NUMBER
from dptrain.train import checkpoint_files, reshard
from dptrain.train.best import Best
from dptrain.train.rundir import run_id


def load_model_state(model, saved: dict, epoch: checkpoint_files.At, run_dir: Path) -> None:
    """Load a checkpoint's model state, or say in one line which key or shape does not fit."""
    try:
        model.load_state_dict(saved)
    except RuntimeError as exc:
        raise UserError(f"the checkpoint of {checkpoint_files.describe(epoch)} in '{run_dir}' does not fit this model: "
                        f"{checkpoint_files.first_mismatch(exc)}") from None


def resume_refusal(out: Path, at: checkpoint_files.At, saved: dict, this_run: Optional[str], data: Optional[dict],
                   changed_data_ok: bool, world: int, strategy: str,
                   other_world_refused: Callable[[bool], Optional[str]], shard_size: int = 1) -> Optional[str]:
    """Why the checkpoint of `at` (its manifest `saved`) cannot be continued by this run on `world` workers, in one
    line, or None: another run's, trained on other data, written by another number of workers than
    `strategy` can resume on (`other_world_refused(within_epoch)`: why not, or None), or within an epoch by
    replica groups of another size than this run's `shard_size` where it cannot (1: unsharded; a manifest without
    one was written unsharded). Checked where the run directory is opened (before anything is written) and again
    where the ranks restore."""
    why = checkpoint_files.foreign(saved, this_run, data, changed_data_ok)
    if why is not None:
        return f"the checkpoint of {checkpoint_files.describe(at)} in '{out}' cannot be continued: {why}"
    written = saved.get("shard_size", 1)  # an unsharded writer: replica groups of one
    if len(saved["members"]) != world or written != shard_size and isinstance(at, tuple):
        refused = other_world_refused(isinstance(at, tuple))
        if refused is not None:
            return (f"the checkpoint of {checkpoint_files.describe(at)} in '{out}' was written by "
                    f"{checkpoint_files.who_wrote(saved)}, and {strategy} cannot resume on another number of "
                    f"workers ({world} now): {refused}; give --workers {len(saved['members'])} to continue it "
                    f"({RESUME_ON_ANY_NUMBER})") if len(saved["members"]) != world else (
                f"the checkpoint of {checkpoint_files.describe(at)} in '{out}' was written within an epoch by "
                f"{_groups(written, 'replica groups of {} ranks', 'unsharded workers')}, and {strategy} cannot "
                f"continue it {_groups(shard_size, 'in replica groups of {}', 'unsharded')}: {refused}; continue it "
                f"{_groups(written, 'with groups of {} ranks', 'with --shard none')} (an epoch's end reshards onto "
                f"any size)")
    return None


def _groups(size: int, sharded: str, unsharded: str) -> str:
    """`sharded` with replica groups of `size` ranks in it (size > 1), else `unsharded`."""
    return sharded.format(size) if size > 1 else unsharded


def source_of(members: list[int], rank: int) -> int:
    """The member (rank of the job) whose files rank `rank` of a new world of any size continues from: its own
    place among the writers, or, in a world larger than theirs, a copy of one of them in turn."""
    return members[rank % len(members)]


class Checkpointer:
    """Saves every `every` epochs into OUT/checkpoints (0: never), and every `every_steps` steps within an
    epoch (0: never), and keeps `keep`; restores the newest, on the world the run has now.

    `identify` says what each checkpoint's manifest records beside its members: the strategy's name, the
    training data's fingerprint and why the strategy cannot resume on another number of workers."""

    def __init__(self, out: Optional[Path], ctx: DistContext, options, log: Callable[[str], None]) -> None:
        """`options`: the run's CheckpointOptions (dptrain.train.state)."""
        self.out, self.ctx, self.every, self.keep, self.log = out, ctx, options.every, options.keep, log
        self.every_steps, self.changed_data_ok = options.every_steps, options.resume_with_changed_data
        self.best = Best(out, ctx, options.monitor, options.early_stop_patience, log)  # --monitor, early stopping
        self.strategy = "local"
        self._fingerprint: Optional[Callable[[], dict]] = None
        self._data: Optional[dict] = None
        self._other_world_refused: Callable[[bool], Optional[str]] = lambda within: None
        self._alone = False
        self._sharded = None  # the strategy, whose replica groups (made at its setup) say how the model is sharded
        self.read_from: list[int] = []  # the job ranks whose files the last restore read

    def identify(self, strategy, data: Callable[[], dict]) -> None:
        """The strategy the run trains with (its name, why it cannot resume on another number of workers, whether
        it can stop early, its replica groups when sharded) and the training data's fingerprint, for each
        checkpoint's manifest."""
        self.strategy, self._fingerprint, self._other_world_refused = strategy.name, data, strategy.refuses_other_world
        self._sharded = strategy
        self._alone = not strategy.meets_at_epoch_ends  # async: each worker saves at its own epoch end
        self.best.check_strategy(strategy)

    def layout(self) -> reshard.Layout:
        """This rank's replica group now (its size, index and place; a group of one when the model is not sharded)."""
        replicas = getattr(self._sharded, "replicas", None)
        if replicas is None:
            return reshard.Layout(1, self.ctx.rank, 0)
        return reshard.Layout(replicas.size, replicas.index, replicas.place)

    def _data_fingerprint(self) -> Optional[dict]:
        if self._data is None and self._fingerprint is not None:
            self._data = self._fingerprint()
        return self._data

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
             position: Optional[dict] = None, members: Optional[tuple[int, ...]] = None) -> None:
        """This rank's state after `epoch` (from 1); `components` map a name to an object with state_dict() or None.

        With `position` (steps > 0 done of epoch `epoch` + 1) it is a checkpoint within that epoch. `members`:
        the ranks of the job that write it (default: the group's); this rank's file is named by its own."""
        if self.out is None:
            return
        members = tuple(members if members is not None else self.ctx.group.members)
        at = checkpoint_files.named(epoch, position["steps"]) if position else epoch
        state = {"epoch": epoch, "step": step, "wall_seconds": wall,
                 **{name: (part.state_dict() if part is not None else {}) for name, part in components.items()},
                 "rng": checkpoint_files.rng_state(), "history": history, **({"position": position} if position else {})}
        job_rank, training = self.ctx.job_rank, faults.where()
        faults.at(job_rank, None if position else epoch)  # the save fault points name epoch ends
        faults.point("save-begin")
        if self.ctx.is_main:  # before its own file: a checkpoint with rank 0's file has its manifest
            size = self.layout().size
            checkpoint_files.write_manifest(self.out, at, members, self.strategy, run_id(self.out),
                                            self._data_fingerprint(), alone=self._alone,
                                            shard_size=size if size > 1 else None)
        checkpoint_files.save(self.out, at, job_rank, state)
        faults.point("save-end")
        # Other files written later are not part of a save; within an epoch, its points (train-middle, regroup)
        # still name it after a checkpoint within it.
        faults.at(*(training if position else (job_rank, None)))
        self.prune()

    def prune(self) -> None:
        """Rank 0: drop the checkpoints beyond `keep` complete ones (after each save, and once every rank's last
        save is done: the newest is counted only when complete)."""
        if self.out is not None and self.ctx.is_main and self.enabled:
            checkpoint_files.prune(self.out, self.keep, self.ctx.world_size)

    def restore(self, components: dict) -> Optional[dict]:
        """Load the newest complete checkpoint into `components` (rank 0 chooses it for all), from the file of
        this rank's member (`source_of`) when another world wrote it, or its rows of the files of one writing
        replica group when replica groups of another size wrote it (dptrain.train.reshard); its state or None.
        The state's "members" are the ranks of the job that wrote it; a rank that continues from a copy of another's
        state has "copy" True, and "shard_size" says the writers' replica groups; within an epoch, its position
        counts the rows read so far as `_counted` shares them out (so that the epoch's record counts every row
        read once)."""
        decision = self.ctx.group.broadcast_object("resume", self._choose() if self.ctx.is_main and self.out else None)
        if decision is None:
            return None
        if decision["refused"]:
            raise UserError(decision["refused"])
        at = decision["at"]
        at = tuple(at) if isinstance(at, list) else at  # JSON carries a point within an epoch as a list
        members, rank, world = list(decision["members"]), self.ctx.rank, self.ctx.world_size
        layout, written = self.layout(), decision.get("shard_size") or 1  # unsharded: groups of one whole replica
        if written != layout.size:
            state, self.read_from = reshard.load_resharded(self.out, at, members, written, layout,
                                                           _unwrapped(components["model"], "module"),
                                                           _unwrapped(components["optimizer"], "optimizer"))
        else:
            self.read_from = [source_of(members, rank)]
            state = checkpoint_files.load(self.out, at, self.read_from[0])
        copy = rank >= len(members) or self.read_from[0] != members[rank]
        for name, part in components.items():
            if name == "model":
                load_model_state(part, state[name], at, self.out)
            elif part is not None and state.get(name):
                part.load_state_dict(state[name])
        if not copy:  # a copy draws its own random numbers (seeded by its rank), not its source's again
            checkpoint_files.set_rng_state(state["rng"])
        if state.get("position"):
            state["position"] = self._counted(at, members, state["position"], copy, written != layout.size)
        self._say_resuming(at, members, written)
        return {**state, "members": members, "copy": copy, "shard_size": written}

    def _counted(self, at, members: list[int], position: dict, copy: bool, resharded: bool) -> dict:
        """A position within an epoch with the rows read so far that this rank's record counts: the epoch's record
        still counts every row read once. On the world that wrote it, its writer's own; else rank r counts those
        of the writers at places r, r + world, ... among them (a copy or a rank past the writers none)."""
        rank, world = self.ctx.rank, self.ctx.world_size
        if len(members) == world and not resharded:
            return position
        places = members[rank::world]
        if resharded:
            theirs = [checkpoint_files.load_mapped(self.out, at, member)["position"] for member in places]
        else:  # its own is the first of them, or, a copy, it has read nothing of the epoch yet
            theirs = ([] if copy else [position]) + [checkpoint_files.load_mapped(self.out, at, member)["position"]
                                                     for member in places[1:]]
        return {**position, "samples": sum(each["samples"] for each in theirs),
                "loss_sum": sum((each["loss_sum"] for each in theirs), torch.zeros_like(position["loss_sum"]))}

    def _choose(self) -> Optional[dict]:
        """Rank 0: the newest complete checkpoint, who wrote it, and why it may not be resumed (None: it may)."""
        at, notes = checkpoint_files.latest_complete(self.out, self.ctx.world_size)
        for note in notes:
            self.log(f"dptrain: {note}")
        if at is None:
            return None
        saved = checkpoint_files.manifest(self.out, at, self.ctx.world_size)
        refused = resume_refusal(self.out, at, saved, run_id(self.out, create=False), self._data_fingerprint(),
                                 self.changed_data_ok, self.ctx.world_size, self.strategy, self._other_world_refused,
                                 self.layout().size)
        return {"at": at, "members": saved["members"], "refused": refused, "shard_size": saved.get("shard_size")}

    def _say_resuming(self, at, members: list[int], written: int) -> None:
        world, size = self.ctx.world_size, self.layout().size
        where = f"at {checkpoint_files.describe(at)}" if isinstance(at, tuple) else f"after epoch {at}"
        if written == 1 and size > 1:
            self.log(f"dptrain: the unsharded checkpoint sharded onto groups of {size}: each rank read its rows of "
                     f"one writer's file")
        elif written != size:
            self.log(f"dptrain: the checkpoint's shards resharded from replica groups of {written} ranks onto "
                     f"{'groups of ' + str(size) if size > 1 else 'unsharded workers'}: each rank read its rows of "
                     f"one writing group's files")
        if members == list(self.ctx.group.members) and (written == size or not isinstance(at, tuple)):
            self.log(f"dptrain: resuming {where} from {self.out}")
            return
        if isinstance(at, tuple):
            over = _groups(size, f"{world // size} replica group{'s' if world > size else ''} of {{}} ranks",
                           f"{world} workers")
            replanned = (f"; the rest of epoch {at[0] + 1} re-planned over {over}"
                         if len(members) != world or written != size else "")
        else:
            replanned = f"; the epochs from {at + 1} on planned over {world} workers" if len(members) != world else ""
        self.log(f"dptrain: resuming {where} from {self.out} on {world} worker{'s' if world != 1 else ''} "
                 f"(written by {checkpoint_files.who_wrote({'members': members})}){replanned}")


def _unwrapped(part, attribute: str):
    """The model or optimizer a checkpoint part stands for (a sharded one's LocalShards hold it as `attribute`)."""
    from dptrain.runtime.sharded import LocalOptimizerShards, LocalShards

    return getattr(part, attribute) if isinstance(part, (LocalShards, LocalOptimizerShards)) else part


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
