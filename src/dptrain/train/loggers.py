"""Where rank 0 logs each epoch while the run trains, beside metrics.jsonl: well-kept libraries, not our own.

- `csv` (always, with an OUT): OUT/metrics.csv, one row per epoch, for a spreadsheet or pandas;
- `tensorboard` (`--tensorboard`): TensorBoard event files in OUT/tensorboard, written by torch's own
  SummaryWriter as each epoch ends (`tensorboard --logdir OUT/tensorboard` shows the run live);
- `mlflow` and `wandb` (`--log-to mlflow,wandb`): the same scalars through each library's own client,
  configured by its own environment (MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME; WANDB_PROJECT,
  WANDB_MODE=offline where there is no network); the run is named after OUT.

Each logger gets the epoch's record (what metrics.jsonl holds) and logs its scalars with the epoch as
the step; a test metric only for an epoch that was evaluated. A library that is not installed is one
line before training starts (`check`), naming the package to install.
"""

from __future__ import annotations

import csv
import importlib.util
import io
from pathlib import Path
from typing import Any, Optional, Sequence

from dptrain.errors import UserError
from dptrain.io import atomic_write_bytes

SCALARS = ("train_loss", "test_loss", "test_accuracy", "lr", "samples_per_second", "comm_bytes", "epoch_seconds")
TEST_METRICS = ("test_loss", "test_accuracy")
CSV_COLUMNS = ("epoch", *SCALARS, "wall_seconds", "evaluated")
NAMES = ("tensorboard", "mlflow", "wandb")
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow (or mlflow-skinny)", "wandb": "wandb"}


def flag(name: str) -> str:
    """How the user asked for logger `name`."""
    return "--tensorboard" if name == "tensorboard" else f"--log-to {name}"


def check(names: Sequence[str]) -> None:
    """One line for an unknown logger or one whose library is missing (before anything trains)."""
    for name in names:
        if name not in NAMES:
            raise UserError(f"logger {name!r} is not one of {', '.join(NAMES)}")
        try:
            missing = importlib.util.find_spec(name) is None
        except (ImportError, ValueError):  # a module set to None in sys.modules: not importable here
            missing = True
        if missing:
            raise UserError(f"{flag(name)} needs the {name} package: pip install {PACKAGES[name].split(' ')[0]}")


def scalars(record: dict) -> dict[str, float]:
    """The scalars of an epoch's record that exist (test metrics only where the epoch was evaluated)."""
    values = {}
    for tag in SCALARS:
        value = record.get(tag)
        if value is None or (tag in TEST_METRICS and not record.get("evaluated", True)):
            continue
        values[tag] = float(value)
    return values


class CSVLog:
    """OUT/metrics.csv: rewritten whole from the history where it changed (a resume, an epoch done again)."""

    def __init__(self, out: Path) -> None:
        self.path = out / "metrics.csv"

    def write(self, history: list[dict]) -> None:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for record in history:
            writer.writerow({key: record.get(key) for key in CSV_COLUMNS})
        atomic_write_bytes(self.path, buffer.getvalue().encode())


class TensorBoardLog:
    def __init__(self, out: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def epoch(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=int(record["epoch"]))
        self.writer.flush()  # seen live, not at the end

    def close(self, summary: dict) -> None:
        self.writer.close()


class MLflowLog:
    def __init__(self, out: Path, settings: dict) -> None:
        import mlflow

        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=out.resolve().name)
        mlflow.log_params({key: value for key, value in settings.items() if value is not None})

    def epoch(self, record: dict) -> None:
        self.mlflow.log_metrics(scalars(record), step=int(record["epoch"]))

    def close(self, summary: dict) -> None:
        self.mlflow.end_run()


class WandbLog:
    def __init__(self, out: Path, settings: dict) -> None:
        import wandb

        self.run = wandb.init(name=out.resolve().name, dir=str(out), config=settings, reinit=True)

    def epoch(self, record: dict) -> None:
        self.run.log(scalars(record), step=int(record["epoch"]))

    def close(self, summary: dict) -> None:
        for key in ("test_accuracy", "test_loss", "wall_seconds", "comm_bytes"):
            if summary.get(key) is not None:
                self.run.summary[key] = summary[key]
        self.run.finish()


class Loggers:
    """The run's loggers on the rank that writes its files, opened at its first epoch (or history)."""

    def __init__(self, names: Sequence[str] = (), settings: Optional[dict] = None) -> None:
        check(names)
        self.names, self.settings = tuple(names), dict(settings or {})
        self.csv: Optional[CSVLog] = None
        self.live: list[Any] = []

    @classmethod
    def of_run(cls, run, strategy, world: int, batch_size: int, optimizer) -> "Loggers":
        """The loggers a Trainer's RunOptions ask for (`tensorboard`, `log_to`: names or "mlflow,wandb"), with the
        settings MLflow and W&B record for the run."""
        log_to = run.log_to.split(",") if isinstance(run.log_to, str) else run.log_to
        names = (*(("tensorboard",) if run.tensorboard else ()), *log_to)
        return cls(names, {"strategy": strategy.name, "workers": world, "batch_size": batch_size,
                           "lr": optimizer.param_groups[0]["lr"], "seed": run.seed})

    def _open(self, out: Path) -> None:
        if self.csv is not None:
            return
        self.csv = CSVLog(out)
        made = {"tensorboard": lambda: TensorBoardLog(out), "mlflow": lambda: MLflowLog(out, self.settings),
                "wandb": lambda: WandbLog(out, self.settings)}
        for name in self.names:
            try:
                self.live.append(made[name]())
            except Exception as exc:  # noqa: BLE001 - the library's own error, said in one line before training
                lines = [line for line in str(exc).splitlines() if line.strip()]
                raise UserError(f"{flag(name)}: {name} could not start logging this run: "
                                f"{(lines[0] if lines else type(exc).__name__)[:300]}") from None

    def start(self, out: Path) -> None:
        """Open every logger now (before training), so that one that cannot start is said before any epoch."""
        self._open(out)

    def epoch(self, out: Path, history: list[dict]) -> None:
        """The epoch just recorded (the last of `history`)."""
        self._open(out)
        self.csv.write(history)
        for log in self.live:
            log.epoch(history[-1])

    def history(self, out: Path, history: list[dict]) -> None:
        """The history replaced (a resume, a take-over): the CSV follows; the live loggers log from here on."""
        self._open(out)
        self.csv.write(history)

    def close(self, summary: dict) -> None:
        for log in self.live:
            log.close(summary)
        self.live = []
