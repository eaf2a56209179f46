"""`dptrain plot`: learning curves of one or more run directories, overlaid in one image.

A 2×2 figure: loss (train solid, test dashed) and test accuracy, against epoch (left) and
against wall time since the run started (right); one colour per run, labelled by strategy and
workers ("sync ×2"), with the run directory added where two labels would otherwise be the same.
Epochs that were not evaluated have no test point; runs without accuracy (regression) draw
their losses only, and when no run has accuracy the figure is the loss row alone.

The image goes to --out, by default RUN/curves.png for one run (beside its metrics.jsonl) and
./curves.png for several; an existing file is replaced only with --force. `--tensorboard DIR`
also writes TensorBoard event files, one subdirectory per run (`tensorboard --logdir DIR`).
matplotlib (and torch, for TensorBoard) load only when the command runs, not for `dptrain --help`.
"""

from __future__ import annotations

import argparse
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from dptrain.config import parse_yaml
from dptrain.errors import UserError
from dptrain.io import atomic_write_bytes, make_dirs

RUN_MARKER = ".dptrain-run"  # what `dptrain train` leaves in a directory it claimed (dptrain.train.rundir.MARKER)

IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")
DEFAULT_NAME = "curves.png"
WIDTH = 10.0  # inches
ROW_HEIGHT = 4.0  # inches per row of panels
DPI = 100
X_AXES = {"epoch": "epoch", "wall_seconds": "wall time since the start (s)"}
TEST_METRICS = ("test_loss", "test_accuracy")
TENSORBOARD_SCALARS = ("train_loss", "test_loss", "test_accuracy", "lr", "comm_bytes")
TENSORBOARD_MISSING = "--tensorboard needs the tensorboard package: pip install tensorboard"


@dataclass
class Run:
    """One run directory as read: its records and what the legend calls it."""

    name: str  # the RUN argument as typed
    path: Path
    strategy: str
    workers: Optional[int]
    records: list[dict]
    label: str = ""

    @property
    def base_label(self) -> str:
        return self.strategy if self.workers is None else f"{self.strategy} ×{self.workers}"


@dataclass
class Curve:
    """One line drawn: which run, which metric against which x, and the points."""

    run: str  # the run's label
    metric: str  # train_loss, test_loss or test_accuracy
    x_axis: str  # epoch or wall_seconds
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.run} {self.metric.replace('_', ' ')}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Draw loss and test accuracy against epoch and against wall time for one or more run "
                          "directories, overlaid and labelled by strategy.")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories (the --out of `dptrain train`)")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help=f"image to write, ending in {', '.join(IMAGE_SUFFIXES)} (default: RUN/{DEFAULT_NAME} "
                             f"for one run, ./{DEFAULT_NAME} for several)")
    parser.add_argument("--force", action="store_true", help="replace an existing image (and TensorBoard events)")
    parser.add_argument("--tensorboard", default=None, metavar="DIR",
                        help="also write TensorBoard event files to DIR, one subdirectory per run "
                             "(needs the tensorboard package)")


# ---------------------------------------------------------------------------------------- reading runs

def read_records(metrics: Path, name: str) -> list[dict]:
    """The epoch records of a metrics.jsonl. A crash while appending leaves at most a partial last
    line (see dptrain.io.append_jsonl); that line is skipped, any other bad line is an error."""
    lines = metrics.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise UserError(f"line {number} of '{metrics}' is not JSON; is '{name}' a dptrain run directory?") from None
        if not isinstance(record, dict) or not isinstance(record.get("epoch"), int):
            raise UserError(f"line {number} of '{metrics}' is not an epoch record (no 'epoch'); "
                            f"is '{name}' a dptrain run directory?")
        records.append(record)
    return records


def _mapping(path: Path, loader) -> dict:
    """A JSON or YAML file's top-level mapping, or {} when it is missing or unreadable (it only names the run)."""
    try:
        data = loader(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def read_run(name: str) -> Run:
    """The run in directory `name`: records from metrics.jsonl, strategy and workers from summary.json,
    or from config.yaml while the run has no summary yet (still running, or stopped)."""
    path = Path(name)
    if not path.exists():
        raise UserError(f"run directory '{name}' does not exist; give run directories (the --out of `dptrain train`)")
    if not path.is_dir():
        raise UserError(f"'{name}' is not a directory; give run directories (the --out of `dptrain train`)")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        if (path / RUN_MARKER).exists() or (path / "config.yaml").is_file():
            raise UserError(f"run '{name}' recorded no epoch (it has a config.yaml but no metrics.jsonl): it stopped "
                            "before its first epoch ended, or has not ended one yet; its output says why; fix that "
                            "and run it again (the same --out takes it), then plot it")
        raise UserError(f"'{name}' is not a dptrain run directory: no metrics.jsonl")
    records = read_records(metrics, name)
    if not records:
        raise UserError(f"run '{name}' has no epochs yet: its metrics.jsonl holds no records")
    about = _mapping(path / "summary.json", json.loads) or _mapping(path / "config.yaml", parse_yaml)
    workers = about.get("workers")
    if not isinstance(workers, int) and isinstance(records[-1].get("workers"), list):
        workers = len(records[-1]["workers"])
    return Run(name=name, path=path, strategy=str(about.get("strategy") or "run"),
               workers=workers if isinstance(workers, int) else None, records=records)


def read_runs(names: list[str]) -> list[Run]:
    """Read every run, then label them: "strategy ×workers", plus " (RUN)" where labels would repeat."""
    seen: dict[Path, str] = {}
    for name in names:
        resolved = Path(name).resolve()
        if resolved in seen:
            raise UserError(f"run '{name}' is given twice (also as '{seen[resolved]}')")
        seen[resolved] = name
    runs = [read_run(name) for name in names]
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.base_label] = counts.get(run.base_label, 0) + 1
    for run in runs:
        run.label = run.base_label if counts[run.base_label] == 1 else f"{run.base_label} ({run.name})"
    return runs


# ---------------------------------------------------------------------------------------- the figure

def evaluated(record: dict) -> bool:
    """Whether the epoch was evaluated (files from before the `evaluated` key: whether it has a test loss)."""
    return bool(record.get("evaluated", record.get("test_loss") is not None))


def curves_of(run: Run) -> list[Curve]:
    """The lines of one run: each metric it has, against epoch and against wall time (empty ones left out)."""
    curves = []
    for metric in ("train_loss", "test_loss", "test_accuracy"):
        points = [record for record in run.records if record.get(metric) is not None
                  and (metric not in TEST_METRICS or evaluated(record))]
        for x_axis in X_AXES:
            usable = [record for record in points if record.get(x_axis) is not None]
            if usable:
                curves.append(Curve(run=run.label, metric=metric, x_axis=x_axis,
                                    x=[record[x_axis] for record in usable], y=[record[metric] for record in usable]))
    return curves


def figure_size(rows: int) -> tuple[float, float]:
    """Inches of a figure with `rows` rows of panels (pixels: times DPI)."""
    return WIDTH, ROW_HEIGHT * rows


def build_figure(runs: list[Run]):
    """(matplotlib Figure, the Curves drawn on it). Rows: loss, then test accuracy if any run has it;
    columns: against epoch, against wall time. No pyplot: nothing global is touched."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    per_run = [(index, curves_of(run)) for index, run in enumerate(runs)]
    metrics = {curve.metric for _, curves in per_run for curve in curves}
    rows = ["loss"] + (["test accuracy"] if "test_accuracy" in metrics else [])
    figure = Figure(figsize=figure_size(len(rows)), dpi=DPI, layout="constrained")
    grid = figure.subplots(len(rows), len(X_AXES), sharex="col", squeeze=False)
    panels = {(row, x_axis): grid[r][c] for r, row in enumerate(rows) for c, x_axis in enumerate(X_AXES)}
    drawn = []
    for index, curves in per_run:
        for curve in curves:
            row = "test accuracy" if curve.metric == "test_accuracy" else "loss"
            panels[row, curve.x_axis].plot(curve.x, curve.y, color=f"C{index % 10}", marker=".",
                                           linestyle="--" if curve.metric in TEST_METRICS else "-",
                                           label=curve.label)
            drawn.append(curve)
    for (row, x_axis), axes in panels.items():
        axes.set_ylabel(row)
        axes.grid(alpha=0.3)
        if row == rows[-1]:
            axes.set_xlabel(X_AXES[x_axis])
        if x_axis == "epoch":
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        else:
            axes.set_xlim(left=0)  # time since the start: runs that start late or slowly show it
    handles = [Line2D([], [], color=f"C{index % 10}", marker=".", label=run.label) for index, run in enumerate(runs)]
    handles += [Line2D([], [], color="grey", linestyle="-", label="train"),
                Line2D([], [], color="grey", linestyle="--", label="test")]
    figure.legend(handles=handles, loc="outside upper center", ncols=min(len(handles), 6), fontsize=8, frameon=False)
    return figure, drawn


def image_bytes(figure, suffix: str) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format=suffix.lstrip(".").lower())
    return buffer.getvalue()


def output_path(out: Optional[str], runs: list[Run], force: bool) -> Path:
    """--out checked (an image suffix, not a directory, not an existing file unless --force), or the default."""
    if out is None:
        path = runs[0].path / DEFAULT_NAME if len(runs) == 1 else Path(DEFAULT_NAME)
    else:
        path = Path(out)
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            raise UserError(f"--out '{out}' is not an image file name; end it in one of {', '.join(IMAGE_SUFFIXES)}")
    if path.is_dir():
        raise UserError(f"--out '{path}' is a directory; give a file name such as {path / DEFAULT_NAME}")
    if path.exists() and not force:
        raise UserError(f"'{path}' already exists; give --force to replace it, or choose another --out")
    return path


# ---------------------------------------------------------------------------------------- TensorBoard

def summary_writer_class():
    """torch's SummaryWriter, or one line saying how to get it (torch imports it from the tensorboard package)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(TENSORBOARD_MISSING) from None
    return SummaryWriter


def tensorboard_dirs(runs: list[Run], directory: Path, force: bool) -> list[Path]:
    """DIR/<run directory name> per run (-2, -3 ... where names repeat); refuses ones holding events unless --force."""
    taken: set[str] = set()
    dirs = []
    for run in runs:
        base = run.path.resolve().name or "run"
        name, number = base, 1
        while name in taken:
            number += 1
            name = f"{base}-{number}"
        taken.add(name)
        log_dir = directory / name
        if not force and log_dir.is_dir() and any(log_dir.glob("events.out.tfevents.*")):
            raise UserError(f"'{log_dir}' already holds TensorBoard events; give --force to replace them, "
                            f"or choose another --tensorboard directory")
        dirs.append(log_dir)
    return dirs


def tensorboard_scalars(run: Run) -> list[tuple[str, float, int, float]]:
    """(tag, value, epoch, wall time) of every scalar of the run. Wall times are seconds since the epoch:
    the run's start (metrics.jsonl's modification time less its last wall_seconds) plus wall_seconds."""
    start = (run.path / "metrics.jsonl").stat().st_mtime - float(run.records[-1].get("wall_seconds") or 0.0)
    scalars = []
    for record in run.records:
        wall = start + float(record.get("wall_seconds") or 0.0)
        for tag in TENSORBOARD_SCALARS:
            value = record.get(tag)
            if value is None or (tag in TEST_METRICS and not evaluated(record)):
                continue
            scalars.append((tag, float(value), int(record["epoch"]), wall))
    return scalars


def write_tensorboard(runs: list[Run], dirs: list[Path], writer_class: Any, force: bool) -> None:
    for run, log_dir in zip(runs, dirs):
        if force and log_dir.is_dir():
            for old in log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        make_dirs(log_dir)
        writer = writer_class(log_dir=str(log_dir))
        try:
            for tag, value, step, wall in tensorboard_scalars(run):
                writer.add_scalar(tag, value, global_step=step, walltime=wall)
        finally:
            writer.close()


# ---------------------------------------------------------------------------------------- the command

def main(args: argparse.Namespace) -> int:
    writer_class = summary_writer_class() if args.tensorboard else None
    runs = read_runs(args.runs)
    out = output_path(args.out, runs, args.force)
    tensorboard = Path(args.tensorboard) if args.tensorboard else None
    if tensorboard is not None and tensorboard.exists() and not tensorboard.is_dir():
        raise UserError(f"--tensorboard '{tensorboard}' is a file; give a directory")
    dirs = tensorboard_dirs(runs, tensorboard, args.force) if tensorboard is not None else []

    figure, _ = build_figure(runs)
    data = image_bytes(figure, out.suffix)
    if out.parent != Path(""):
        make_dirs(out.parent)
    atomic_write_bytes(out, data)
    print(f"wrote {out}")
    if tensorboard is not None:
        write_tensorboard(runs, dirs, writer_class, args.force)
        print(f"wrote TensorBoard events of {len(runs)} run{'s' if len(runs) > 1 else ''} to {tensorboard} "
              f"(view with: tensorboard --logdir {tensorboard})")
    return 0
