"""What a run reports: per-epoch records (metrics.jsonl, and through dptrain.train.loggers metrics.csv,
TensorBoard, MLflow, W&B), the console line, the progress bar, the summary.

Only rank 0 writes and prints; every rank keeps the history, because it goes into each rank's
checkpoint. Files are written atomically (dptrain.io) into the run directory, created on the
first write.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from dptrain.runtime.sharded import full_state
from dptrain.io import append_jsonl, make_dirs, save_torch, write_json, write_jsonl
from dptrain.train.loggers import Loggers


@dataclass
class EpochStats:
    """What one worker measured in one epoch."""

    rank: int
    samples: int
    train_loss: float
    train_seconds: float
    comm_bytes: int


@dataclass
class Summary:
    """The result of Trainer.fit (summary.json holds `to_dict()`)."""

    strategy: str
    strategy_options: dict
    workers: int
    epochs: int
    test_accuracy: Optional[float]
    test_loss: Optional[float]
    wall_seconds: float
    samples_per_second: float
    comm_bytes: int  # all workers together (those gone from the run too: Recorder.departed_bytes)
    comm_bytes_per_worker: list
    model_parameters: int
    backend: str
    device: str
    launcher: str
    seed: int
    strategy_results: dict = field(default_factory=dict)  # e.g. async merges, fedavg rounds
    data: Optional[dict] = None  # what `dptrain train` trained on: source, task, input shape, classes, samples

    @classmethod
    def from_dict(cls, record: dict) -> "Summary":
        """The inverse of to_dict (e.g. of a summary.json)."""
        known = {name for name in cls.__dataclass_fields__ if name != "strategy_results"}
        return cls(**{k: v for k, v in record.items() if k in known},
                   strategy_results={k: v for k, v in record.items() if k not in known})

    def to_dict(self) -> dict:
        record = asdict(self)
        record.update(record.pop("strategy_results"))
        return record


def aggregate(per_worker: list[EpochStats], departed_bytes: int = 0) -> dict:
    """The fields of an epoch record that sum or compare the workers' numbers (comm_bytes: with those of
    workers gone from the run, `departed_bytes`)."""
    samples = sum(s.samples for s in per_worker)
    return {
        "train_loss": sum(s.train_loss * s.samples for s in per_worker) / max(samples, 1),
        "samples_per_second": sum(s.samples / max(s.train_seconds, 1e-9) for s in per_worker),
        "comm_bytes": sum(s.comm_bytes for s in per_worker) + departed_bytes,
        "epoch_seconds": max(s.train_seconds for s in per_worker),
        "workers": [vars(s) for s in per_worker],
    }


class Recorder:
    """Keeps the history; rank 0 writes metrics.jsonl, prints epoch lines and draws the progress bar."""

    def __init__(self, out: Optional[Path], is_main: bool, verbose: bool = True, progress: bool = True,
                 world_size: int = 1, loggers: Optional[Loggers] = None) -> None:
        self.out, self.is_main, self.world_size = out, is_main, world_size
        self.loggers = loggers if loggers is not None else Loggers()  # metrics.csv, TensorBoard, MLflow, W&B
        self.job_world = world_size  # the workers the job started with; world_size follows the live membership
        self.members: Optional[tuple[int, ...]] = None  # ranks of the job still training, after a membership change
        # Bytes the workers gone from the run had communicated (in the record of the last epoch they trained in):
        # part of every total from then on, as the bytes they sent went over the network all the same.
        self.departed_bytes = 0
        self.rank: Optional[int] = None  # this rank of the job, once it took over from a lost rank 0 (`take_over`)
        self._recorded_by: dict[int, tuple[int, ...]] = {}  # epoch -> the members (ranks of the job) recording it
        self._verbose_asked = verbose
        self._progress_asked = progress and (sys.stderr.isatty() or os.environ.get("DPTRAIN_TTY") == "1")
        self.verbose = verbose and is_main
        self.show_progress = self._progress_asked and is_main
        self.history: list[dict] = []
        if self.is_main and self.out and self.loggers.names:
            make_dirs(self.out)
            self.loggers.start(self.out)

    def log(self, message: str) -> None:
        if self.verbose:
            print(message, flush=True)

    def progress_bar(self, total: int, epoch: int, epochs: int) -> tqdm:
        return tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}{self._live(' · ')}", leave=False,
                    disable=not self.show_progress, dynamic_ncols=True)

    def lead(self, is_main: bool) -> None:
        """Whether this rank writes the files and lines from now on (it became rank 0 of a new group)."""
        self.is_main = is_main
        self.verbose, self.show_progress = self._verbose_asked and is_main, self._progress_asked and is_main

    def take_over(self, rank: int) -> None:
        """Write the files and lines from now on, in place of a rank 0 lost while the others went on without it
        (async): metrics.jsonl becomes this rank's history, with the evaluations the lost rank had written
        (the global model was on it; this rank's own records hold none before now). `rank`: this rank of the job."""
        self.lead(True)
        self.rank = rank
        path = self._file("metrics.jsonl")
        written = {}
        if path is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short as its writer died
                    continue
                written[record.get("epoch")] = record
        for record in self.history:
            before = written.get(record["epoch"])
            if before is not None and before.get("evaluated") and not record["evaluated"]:
                record.update(test_loss=before["test_loss"], test_accuracy=before["test_accuracy"], evaluated=True)
        self.replace_history(self.history)

    def follow(self, members: tuple[int, ...]) -> None:
        """The live membership changed: `members`, the ranks of the job that train on (dptrain.runtime.membership).
        The workers gone keep their bytes in the totals (`departed_bytes`), as of the last epoch recorded."""
        if self.history:
            last = self.history[-1]
            before = self._recorded_by.get(last["epoch"], tuple(range(self.job_world)))
            gone = {place for place, rank in enumerate(before) if rank not in members}
            kept = [worker for worker in last["workers"] if worker["rank"] not in gone]
            self.departed_bytes = last["comm_bytes"] - sum(worker["comm_bytes"] for worker in kept)
        self.members, self.world_size = tuple(members), len(members)

    def resume_without(self, places: int) -> None:
        """The run resumed from a checkpoint of other members than it has now, on whose first `places` workers'
        states it carries on: the bytes of the others (and of those gone before), as the last record has them,
        stay in every total from now on, as after a membership change (`follow`)."""
        if self.history:
            last = self.history[-1]
            self.departed_bytes = last["comm_bytes"] - sum(worker["comm_bytes"] for worker in last["workers"][:places])

    def _live(self, before: str) -> str:
        """The live membership where it differs from the job's start: "2 of 3 workers (ranks 0, 1)", or
        "4 workers, 1 more than at the start (ranks 0, 1, 2, 3)" grown beyond it."""
        if self.members is None or len(self.members) == self.job_world:
            return ""
        ranks = f"rank{'s' if len(self.members) != 1 else ''} {', '.join(map(str, self.members))}"
        if len(self.members) > self.job_world:
            return f"{before}{len(self.members)} workers, {len(self.members) - self.job_world} more than at the start ({ranks})"
        return f"{before}{len(self.members)} of {self.job_world} workers ({ranks})"

    def _file(self, name: str) -> Optional[Path]:
        if not (self.is_main and self.out):
            return None
        make_dirs(self.out)
        return self.out / name

    def record(self, epoch: int, epochs: int, per_worker: list[EpochStats], test: Optional[dict], wall: float,
               lr: float, checked: Optional[dict] = None) -> dict:
        """`checked`: what the check of this epoch's average found (average_check, collapse, lr_backoff)."""
        record = {
            "epoch": epoch + 1,
            "test_loss": test["test_loss"] if test else None,
            "test_accuracy": test["test_accuracy"] if test else None,
            "evaluated": test is not None,
            "wall_seconds": wall,
            "lr": lr,
            **aggregate(per_worker, self.departed_bytes),
            **(checked or {}),
        }
        self._recorded_by[epoch + 1] = self.members if self.members is not None else tuple(range(self.job_world))
        if self.history and self.history[-1]["epoch"] > epoch:  # an epoch done again replaces its records from then
            self.replace_history([kept for kept in self.history if kept["epoch"] <= epoch])
        self.history.append(record)
        if path := self._file("metrics.jsonl"):
            append_jsonl(path, record)
            self.loggers.epoch(self.out, self.history)
        accuracy = f"  test_acc {test['test_accuracy']:.4f}" if test and test["test_accuracy"] is not None else ""
        test_loss = f"  test_loss {test['test_loss']:.4f}" if test else ""
        # Without a barrier (async) an epoch's record holds this rank's numbers only, until the run
        # ends and fills in every worker's: the line says whose they are, as the file does.
        alone = per_worker[0].rank if self.rank is None else self.rank
        whose = "" if len(per_worker) == self.world_size else f"  (rank {alone} alone)"
        self.log(f"epoch {epoch + 1}/{epochs}  train_loss {record['train_loss']:.4f}{test_loss}{accuracy}  "
                 f"{record['epoch_seconds']:.2f} s  {record['samples_per_second']:,.0f} samples/s  "
                 f"comm {record['comm_bytes'] / 1e6:,.3f} MB so far{whose}{self._live('  ')}")
        return record

    def replace_history(self, history: list[dict]) -> None:
        """Adopt `history` (from a checkpoint, or completed with every worker's numbers) and rewrite the file."""
        self.history = list(history)
        if path := self._file("metrics.jsonl"):
            write_jsonl(path, self.history)
            self.loggers.history(self.out, self.history)

    def complete(self, workers: dict[int, list[dict]]) -> None:
        """Fill in every worker's numbers {epoch: [worker stats]} where the live records held only one rank's."""
        for record in self.history:
            if workers.get(record["epoch"]):
                record.update(aggregate([EpochStats(**worker) for worker in workers[record["epoch"]]]))
        self.replace_history(self.history)

    def made_up(self, rows: dict[int, int]) -> None:
        """{epoch: rows of it trained at the end} (dptrain.train.make_up), in those epochs' records."""
        for record in self.history:
            if record["epoch"] in rows:
                record["rows_made_up"] = record.get("rows_made_up", 0) + rows[record["epoch"]]
        self.replace_history(self.history)

    def last_evaluation(self) -> dict:
        return {key: self.history[-1][key] for key in ("test_loss", "test_accuracy")}

    def samples(self) -> int:
        return sum(sum(worker["samples"] for worker in record["workers"]) for record in self.history)

    def write_final(self, summary: Summary, model: torch.nn.Module) -> None:
        """model.pt (the final global state_dict, on the CPU) and summary.json; then the run's last line
        (dptrain's own launcher prints that line itself, from summary.json, once its workers are done)."""
        path = self._file("model.pt")
        state = full_state(model, wanted=path is not None)  # a sharded model's, gathered: every rank calls it
        if path:
            save_torch(path, state)
            write_json(self.out / "summary.json", summary.to_dict())
            self.loggers.close(summary.to_dict())
        if os.environ.get("DPTRAIN_LAUNCHER") != "local":
            self.log(summary_line(summary, self.out))


def summary_line(summary: Summary, out: Optional[Path]) -> str:
    """One line with what summary.json says: final accuracy and loss, wall time, bytes, where model.pt is."""
    result = []
    if summary.test_accuracy is not None:
        result.append(f"test_acc {summary.test_accuracy:.4f}")
    if summary.test_loss is not None:
        result.append(f"test_loss {summary.test_loss:.4f}")
    where = f"model in {Path(out) / 'model.pt'}" if out else "no --out, so no model.pt"
    return (f"dptrain: done: {summary.strategy} on {summary.workers} worker{'s' if summary.workers > 1 else ''}, "
            f"{summary.epochs} epochs in {summary.wall_seconds:,.1f} s; final model {', '.join(result) or 'not evaluated'}; "
            f"{summary.comm_bytes:,} bytes communicated; {where}")
